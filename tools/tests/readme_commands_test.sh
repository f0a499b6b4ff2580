#!/usr/bin/env bash
# The README's `ddo` command block, run as a user pastes it: every indented line of the section
# "The `ddo` command", in order, with `ddo` the built program and the try-out folder a temporary
# one. Fails on the first line that fails. ctest runs it (readme_commands, label torch):
#
#   bash tools/tests/readme_commands_test.sh <path to the built ddo> <README.md>
set -euo pipefail
program=$1 readme=$2
work=$(mktemp -d "${TMPDIR:-/tmp}/ddo-readme.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/bin"
ln -s "$program" "$work/bin/ddo"
# The indented lines between the section's heading and the next heading.
awk '/^## The `ddo` command/ {on = 1; next} /^## / {on = 0} on && /^    [a-z]/' "$readme" |
  sed -e 's/^    //' -e "s|/tmp/ddo-try|$work/profiles|" >"$work/commands.sh"
[ "$(wc -l <"$work/commands.sh")" -ge 5 ] || { echo "readme_commands: no commands found" >&2; exit 1; }
echo "readme_commands: running:" && cat "$work/commands.sh"
cd "$work"
env -u DDO_PRESET PATH="$work/bin:$PATH" HOME="$work" bash -euo pipefail "$work/commands.sh"
echo "readme_commands: every command of the README's ddo section ran"
