#!/usr/bin/env bash
# A commit's tree for the GPU machine, apart from uncommitted work: the device call copies the
# working tree, so edits in progress (a helper's half-done change) would build there too. This
# writes the commit into .export/ (ignored), with links to .deps/ and .whl/, and prints the run
# line that builds it.
#
#   bash scripts/gpu-export.sh HEAD        # then, carry [".deps", ".whl", ".export"]:
#   cd .export && DDO_GPU_BUILD=/tmp/ddo-build-gpu DDO_COMMIT=<sha> bash scripts/gpu.sh test
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
rev=$(git rev-parse --short "${1:-HEAD}")
rm -rf .export
mkdir .export
git archive "$rev" | tar -x -C .export
ln -s ../.deps .export/.deps
ln -s ../.whl .export/.whl
echo "exported $rev to .export/; device run, carry [\".deps\", \".whl\", \".export\"]:"
echo "  cd .export && DDO_GPU_BUILD=/tmp/ddo-build-gpu DDO_COMMIT=$rev bash scripts/gpu.sh <mode>"
