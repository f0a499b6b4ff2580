#!/usr/bin/env bash
# Fails when code outside core's platform layer includes a header that exists on one system only
# (POSIX's unistd.h, sys/*.h, malloc.h, ...; Windows' windows.h, io.h): such calls belong in
# core/include/ddo/core/os_memory.h, core/src/os_file.h or core/tests/test_files.h, so that the
# Windows port of the adapter and the bindings is a build problem, not a code hunt.
# ctest runs it (test platform_includes, label core); by hand: bash scripts/check-platform-includes.sh
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
pattern='^[[:space:]]*#[[:space:]]*include[[:space:]]*<(unistd|malloc|fcntl|dlfcn|pthread|ftw|dirent|poll|pwd|grp|termios|spawn|libgen|strings|syslog|netdb|aio|sched|semaphore|windows|io|process|direct|winsock2|ws2tcpip|shlobj|knownfolders)\.h>|^[[:space:]]*#[[:space:]]*include[[:space:]]*<(sys|arpa|netinet)/'
found=$(grep -rEn "$pattern" torch python/src sdnq engine/include tools bench examples \
  --include='*.cpp' --include='*.h' --include='*.hpp' --include='*.cu' || true)
if [ -n "$found" ]; then
  echo "platform_includes: system-specific headers outside core's platform layer:" >&2
  echo "$found" >&2
  echo "move the call into core (ddo/core/os_memory.h, core/src/os_file.h) or core/tests/test_files.h" >&2
  exit 1
fi
echo "platform_includes: no system-specific header in torch/, python/src/, sdnq/, engine's headers, tools/, bench/, examples/"
