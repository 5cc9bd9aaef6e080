#!/usr/bin/env bash
# Installs every build and test dependency of Spindle from Debian's archive.
set -euo pipefail
packages=(
  build-essential cmake git pkg-config
  libopenblas-dev nlohmann-json3-dev libgtest-dev libgmock-dev
  libtomlplusplus-dev libhts-dev zlib1g-dev
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
else
  echo "setup: all Debian packages present"
fi
