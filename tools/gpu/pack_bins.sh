#!/usr/bin/env bash
# Packs binaries built here (-DSPECULA_CUDA=ON, sm_90a) for the GPU machine:
# stripped and xz-compressed into DEST/bin, and the shared libraries of the
# lab's plots (cairo and what it loads), which that machine lacks, into
# DEST/lib. unpack_bins (tools/gpu/lib.sh: dspark_run.sh, engine_run.sh) puts
# DEST/lib on LD_LIBRARY_PATH.
#
#   bash tools/gpu/pack_bins.sh [BUILD_DIR=build] [DEST=.gpu]
# then carry DEST/bin and DEST/lib to the run (DEST is ignored by git when it
# is listed in .git/info/exclude; keep it out of commits).
set -euo pipefail
build=${1:-build}
dest=${2:-.gpu}
rm -rf "$dest/bin" "$dest/lib"
mkdir -p "$dest/bin" "$dest/lib"
for b in "$build/apps/specula" "$build/tests/specula_cuda_tests"; do
  [[ -x $b ]] || { echo "pack_bins: $b is missing (build it first)" >&2; exit 1; }
  strip -o "$dest/bin/$(basename "$b")" "$b"
  xz -T2 -6 -f "$dest/bin/$(basename "$b")"
done
# Everything cairo pulls in, but not glibc, the C++ runtime or CUDA's own.
ldd "$build/apps/specula" | awk '/=>/ {print $3}' |
  grep -E 'cairo|pixman|fontconfig|freetype|png16|xcb|Xrender|X11|Xext|libz\.so|expat|brotli|Xau|Xdmcp|libbsd|libmd\.so' |
  xargs -r -I{} cp -L {} "$dest/lib/"
du -sh "$dest/bin" "$dest/lib"
