# shellcheck shell=bash
# Sourced by the GPU-machine scripts (gpu.sh and the step scripts it calls: gpu-w2.sh,
# gpu-jit.sh); not run on its own. Expects ROOT, PY, BUILD, LOG and a say() function.

# The wheels the GPU machine lacks (.whl: diffusers, accelerate, sdnq, ...), installed into
# /tmp/ddo-site; PYTHONPATH gets the build tree's ddo package and that site.
#   install_wheels           once per machine (the site's .done mark)
#   install_wheels MODULES   whenever "import MODULES" fails (a site made before a wheel
#                            travelled lacks it: install again, upgrading)
SITE=/tmp/ddo-site
# shellcheck disable=SC2120  # MODULES is optional
install_wheels() {
  export PYTHONPATH="$BUILD/python:$SITE${PYTHONPATH:+:$PYTHONPATH}"
  if [ -n "${1:-}" ]; then
    "$PY" -c "import $1" >>"$LOG" 2>&1 && return 0
  else
    [ -f "$SITE/.done" ] && return 0
  fi
  if ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$ROOT"/.whl/*.whl >>"$LOG" 2>&1 && touch "$SITE/.done" ||
      say "wheel install from .whl failed ($LOG)"
  elif [ -n "${1:-}" ]; then
    say "cannot import $1 and no wheels in .whl: run scripts/gpu-prepare-deps.sh here and carry .whl"
  fi
}
