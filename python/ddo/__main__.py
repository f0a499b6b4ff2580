"""The ``ddo`` command from Python: ``python -m ddo ...`` and the ``ddo`` console script of the
wheel run the C++ program (tools/cli) that the package carries in ``ddo/bin``, with the same
arguments, so there is one command line, written once.

    python -m ddo presets
    python -m ddo profiles list
    python -m ddo --version
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def program() -> Path:
    """The packaged ``ddo`` program (installed: ``ddo/bin/ddo``; build tree: the same place)."""
    name = "ddo.exe" if os.name == "nt" else "ddo"
    return Path(__file__).resolve().parent / "bin" / name


def main(argv: list[str] | None = None) -> int:
    exe = program()
    if not exe.is_file():
        sys.stderr.write(
            f"ddo: the ddo program is not in this installation ({exe}); reinstall the package "
            "(pip install --no-build-isolation .) or build the `ddo` target\n")
        return 2
    args = [str(exe), *(sys.argv[1:] if argv is None else argv)]
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name == "nt":
        import subprocess

        return subprocess.call(args)
    os.execv(str(exe), args)  # replaces this process: exit code and signals are the program's
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
