#!/usr/bin/env bash
# Builds the ddo wheel and checks it as a user gets it: `pip wheel` (the build's output shown as it
# goes), then an install into a fresh virtual environment, where `ddo --version`,
# `python -m ddo presets` and the README's Python example run (on the sim device).
#
#   bash scripts/wheel.sh                  # wheel in dist/; DDO_WHEEL_DIR overrides
#   DDO_WHEEL_FRESH_TORCH=1 bash scripts/wheel.sh
#
# The fresh environment sees torch 2.11.0 through a .pth file naming the project venv's
# site-packages (no second multi-GB torch install per run); DDO_WHEEL_FRESH_TORCH=1 pip-installs
# torch into it instead. The wheel's own files (the package, libddo_torch.so, the ddo program,
# LICENSE) come only from the wheel. .ci/run runs this after the tests.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
ddo_venv
start=$(date +%s)
out=${DDO_WHEEL_DIR:-$DDO_ROOT/dist}
mkdir -p "$out"
rm -f "$out"/ddo-*.whl

# ccache through scikit-build-core's CMAKE_ARGS (scripts/common.sh set CCACHE_DIR/BASEDIR).
if [ ${#DDO_CCACHE_ARGS[@]} -gt 0 ]; then
  export CMAKE_ARGS="${CMAKE_ARGS:-} ${DDO_CCACHE_ARGS[*]}"
fi
echo "wheel: pip wheel --no-build-isolation . (the build is shown below)" >&2
(cd "$DDO_ROOT" && CMAKE_BUILD_PARALLEL_LEVEL="${DDO_JOBS:-$(nproc)}" \
  "$DDO_VENV/bin/pip" wheel -v --no-build-isolation --no-deps --disable-pip-version-check \
  -w "$out" .)
wheel=$(ls "$out"/ddo-*.whl)
echo "wheel: built $(basename "$wheel") ($(du -h "$wheel" | cut -f1)) in $(($(date +%s) - start)) s" >&2

for f in ddo/__init__.py ddo/__main__.py ddo/bin/ddo ddo/libddo_torch.so ddo/libddo_sdnq.so ddo/libddo_core.so \
  'ddo/_C.*.so' 'ddo-*.dist-info/licenses/LICENSE' 'ddo-*.dist-info/entry_points.txt'; do
  if ! "$DDO_VENV/bin/python" - "$wheel" "$f" <<'PY'
import fnmatch, sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
sys.exit(0 if any(fnmatch.fnmatch(n, sys.argv[2]) for n in names) else 1)
PY
  then
    echo "wheel: $(basename "$wheel") lacks $f" >&2
    exit 1
  fi
done

work=$(mktemp -d "${TMPDIR:-/tmp}/ddo-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT
"$DDO_PY" -m venv "$work/venv"
site=$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ "${DDO_WHEEL_FRESH_TORCH:-0}" = 1 ]; then
  "$work/venv/bin/pip" install -q --disable-pip-version-check -r "$DDO_ROOT/python/requirements-torch.txt"
else
  "$DDO_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
    >"$site/ddo-wheel-test-torch.pth"
fi
"$work/venv/bin/pip" install -q --disable-pip-version-check --no-deps "$wheel"

cd "$work"
export DDO_PROFILE_DIR="$work/profiles"
"$work/venv/bin/ddo" --version | tee "$work/version.txt"
grep -q "^ddo [0-9.]* (torch 2.11.0)" "$work/version.txt"
"$work/venv/bin/python" -m ddo presets | grep -q one_shot_fast
where=$("$work/venv/bin/python" -c 'import ddo, os; print(os.path.dirname(ddo.__file__))')
case "$where" in
  "$work"/venv/*) ;;
  *) echo "wheel: ddo was imported from $where, not from the fresh environment" >&2; exit 1 ;;
esac
"$DDO_VENV/bin/python" - "$DDO_ROOT/README.md" >"$work/example.py" <<'PY'
import re, sys
print(re.findall(r"```python\n(.*?)```", open(sys.argv[1]).read(), flags=re.S)[0])
PY
"$work/venv/bin/python" "$work/example.py" | tee "$work/example.txt"
grep -q "^saved " "$work/example.txt" && grep -q "^applied$" "$work/example.txt"
echo "wheel: installed into a fresh environment; ddo --version, python -m ddo and the README" \
  "example ran ($(($(date +%s) - start)) s in all)"
