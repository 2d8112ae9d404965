#!/usr/bin/env bash
# Installs every Debian package the build and the tests need. Idempotent: it
# asks apt only for what is missing, and says nothing when all is present.
#
#   bash scripts/setup.sh            # build + tests
#   bash scripts/setup.sh --train    # also what tools/train needs on this machine's CPUs
set -euo pipefail

train=0
for arg in "$@"; do
  case $arg in
    --train) train=1 ;;
    -h | --help)
      sed -n '2,8p' "$0"
      exit 0
      ;;
    *)
      echo "setup: unknown option '$arg' (known: --train)" >&2
      exit 2
      ;;
  esac
done

packages=(
  cmake ninja-build g++
  libgtest-dev libgmock-dev
  nlohmann-json3-dev libcli11-dev libfmt-dev libspdlog-dev
  clang libclang-rt-14-dev
  pkg-config libcairo2-dev
)
# --train: Debian's PyTorch (CPU) for tools/train, with OpenBLAS. Without libopenblas0 that torch
# multiplies through the reference BLAS behind libblas.so.3, about ten times slower.
if ((train)); then
  packages+=(python3-torch python3-numpy libopenblas0-pthread)
fi

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

# Optional: Debian's Chromium for the chat page's browser test
# (tests/server/node). Without it that test is skipped and says so.
if ! dpkg-query -W -f='${Status}' chromium 2>/dev/null | grep -q "install ok installed"; then
  echo "setup: installing chromium (for the chat page's browser test)"
  sudo_cmd=()
  if [[ $(id -u) -ne 0 ]]; then sudo_cmd=(sudo); fi
  export DEBIAN_FRONTEND=noninteractive
  if ! { "${sudo_cmd[@]}" apt-get update -qq &&
    "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends chromium >/dev/null; }; then
    echo "setup: chromium could not be installed; the chat page test will be skipped"
  fi
fi
