#!/usr/bin/env bash
# Before sending build/ to a GPU machine whose image is not Debian: copy the shared libraries
# Spindle links that such an image may lack (htslib and its codecs, toml++) into build/devlibs.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build/devlibs
for binary in build/spindle build/tests/spindle_gpu_tests; do
  [ -x "$binary" ] || continue
  ldd "$binary" | awk '/=> \// {print $3}' | grep -E 'libhts|libdeflate|libhtscodecs|libtomlplusplus' | while read -r lib; do
    cp -L "$lib" build/devlibs/
  done
done
ls build/devlibs
