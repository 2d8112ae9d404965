#!/usr/bin/env bash
# Installs every Debian package the build and the tests need. Idempotent: it
# asks apt only for what is missing, and says nothing when all is present.
set -euo pipefail

packages=(
  cmake ninja-build g++
  libgtest-dev libgmock-dev
  nlohmann-json3-dev libcli11-dev libfmt-dev libspdlog-dev
  clang libclang-rt-14-dev
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} > 0)); then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=()
  if [[ $(id -u) -ne 0 ]]; then sudo_cmd=(sudo); fi
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
