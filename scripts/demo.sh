#!/usr/bin/env bash
# The README's main job: builds ddo, then calibrates a small DiT under a named profile and runs it
# again applying the saved recommendation. On a machine without a GPU it runs on the host
# simulation device; with CUDA it uses the GPU.
"$(dirname "${BASH_SOURCE[0]}")/install-deps.sh"
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
ddo_build >&2
export DDO_PROFILE_DIR=${DDO_PROFILE_DIR:-$DDO_BUILD/demo-profiles}
"$DDO_BUILD/tools/ddo" demo --profile demo-dit --calibrate "$@"
"$DDO_BUILD/tools/ddo" demo --profile demo-dit "$@"
