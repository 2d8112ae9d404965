#!/usr/bin/env bash
# Configures and builds specula into a build directory (default: build).
# Usage: scripts/build.sh [BUILD_DIR] [extra cmake args...]
# SPECULA_TARGET=specula builds only the CLI (what scripts/demo.sh needs).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build_dir=${1:-$root/build}
shift || true
jobs=${SPECULA_JOBS:-$(nproc)}
cmake -S "$root" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build "$build_dir" -j "$jobs" ${SPECULA_TARGET:+--target "$SPECULA_TARGET"}
