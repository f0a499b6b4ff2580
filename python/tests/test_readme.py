"""The README as a new user reads it: its Python example, pasted as it is, runs on the sim device
(calibrate, then reuse, outputs equal) and prints what the README says it prints; its links point
at files that exist."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def python_blocks(text):
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_the_python_example_runs_as_pasted(tmp_path):
    blocks = python_blocks(README.read_text())
    assert len(blocks) == 1, "the README has one Python example"
    script = tmp_path / "example.py"
    script.write_text(blocks[0])
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDO_")}
    env["DDO_PROFILE_DIR"] = str(tmp_path / "profiles")
    # The ddo these tests import (a build tree or an installed package), from any folder.
    import ddo

    package_root = str(Path(ddo.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 2, done.stdout
    status, budget = lines[0].split()[:2]
    assert status == "saved", lines[0]
    # The pretend card holds some blocks but not all 48 MiB of weights.
    assert 0.0 < float(budget) < 0.047, lines[0]
    assert lines[1] == "applied", lines[1]
    assert (tmp_path / "profiles").is_dir()


def test_the_readme_is_short_and_its_links_exist():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        assert (ROOT / target).exists(), target
    for path in re.findall(r"`((?:examples|tools|scripts|docs)/[^`*]+?)`", text):
        assert (ROOT / path).exists(), path
