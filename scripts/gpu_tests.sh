#!/usr/bin/env bash
# The GPU tests (ctest -L gpu) over an existing build, on a machine with an NVIDIA GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d build/devlibs ]; then export LD_LIBRARY_PATH="$PWD/build/devlibs:${LD_LIBRARY_PATH:-}"; fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
ctest --test-dir build -L gpu --output-on-failure
