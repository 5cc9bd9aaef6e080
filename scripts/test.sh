#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine, builds Spindle and runs every CPU test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build -j"$(nproc)"
ctest --test-dir build --output-on-failure -j"$(nproc)" -LE gpu
