#!/usr/bin/env bash
# The C++ API reference: doxygen over the installed headers (cmake/public-headers.txt, the list
# `cmake --install` installs) into build-docs/html (index.html). Fails, listing them, on any
# doxygen warning, an undocumented public name included (docs/api/Doxyfile).
#
#   bash scripts/docs.sh                    # DDO_DOCS_OUT=<folder> to write elsewhere
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${DDO_DOCS_OUT:-$root/build-docs}
command -v doxygen >/dev/null || {
  echo "docs: doxygen is not installed (Debian: apt-get install doxygen, as" \
    "scripts/install-deps.sh does)" >&2
  exit 1
}
rm -rf "$out"
mkdir -p "$out"
version=$(sed -n 's/^project(ddo VERSION \([0-9.]*\).*/\1/p' "$root/CMakeLists.txt")
cd "$root"
# The list's paths (relative to the root), one doxygen INPUT value.
input=$(grep -v -e '^#' -e '^[[:space:]]*$' cmake/public-headers.txt | tr '\n' ' ')
if ! DDO_DOCS_OUT="$out" DDO_VERSION="$version" DDO_DOCS_INPUT="$input" doxygen docs/api/Doxyfile; then
  echo "docs: doxygen failed; its warnings ($out/warnings.log):" >&2
  cat "$out/warnings.log" >&2
  exit 1
fi
if [ -s "$out/warnings.log" ]; then
  cat "$out/warnings.log" >&2
  echo "docs: $(wc -l <"$out/warnings.log") warning lines (listed above)" >&2
  exit 1
fi
echo "docs: $out/html/index.html" >&2
