#!/usr/bin/env bash
# Lists the read-only-path loads (ld.global.nc) of every programmatic dependent
# kernel (one whose PTX has griddepcontrol.wait) of the CUDA backend, by source
# line, so that each can be checked to read a weight, never an activation
# (cuda_launch.cuh says why: ptxas may hoist such loads above the wait).
#   bash tools/gpu/pdl_audit.sh [file.cu ...]   (default: engine/backend/cuda/*.cu)
# Needs nvcc that targets sm_90a (CUDA 12 or later); no GPU.
# Output: "<kernel> <file>:<line> <loads before the wait> <after>" per line,
# kernels' template arguments dropped and their instantiations merged.
set -euo pipefail
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
cd "$(dirname "$0")/../.."
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
if [[ ! -x $NVCC ]]; then
  echo "pdl_audit: no nvcc at $NVCC (put it on PATH or set NVCC)" >&2
  exit 1
fi
files=("$@")
[[ ${#files[@]} -eq 0 ]] && files=(engine/backend/cuda/*.cu)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for f in "${files[@]}"; do
  ptx=$tmp/$(basename "$f" .cu).ptx
  "$NVCC" -ptx -arch=sm_90a -std=c++20 -O3 -DNDEBUG -DFMT_USE_CONSTEXPR=1 --expt-relaxed-constexpr \
    -lineinfo -I. "$f" \
    -o "$ptx"
  # Two passes over the PTX: its .file table comes last.
  awk '
    FNR == NR { if ($1 == ".file") { gsub(/[",]/, "", $3); n = split($3, parts, "/"); file[$2] = parts[n]; cuda[$2] = ($3 !~ /\/engine\//) } next }
    /^\.(visible \.)?entry / || /^\.entry / {
      flush(); name = $NF; sub(/\($/, "", name); waits = 0; split("", before); split("", after); next }
    $1 == ".loc" {
      # Inside a header not ours (an intrinsic such as __ldg): the line of ours that called it.
      if (cuda[$2] && match($0, /inlined_at [0-9]+ [0-9]+/)) {
        split(substr($0, RSTART, RLENGTH), at, " "); loc = file[at[2]] ":" at[3]
      } else { loc = file[$2] ":" $3; sub(/,$/, "", loc) }
    }
    /griddepcontrol\.wait/ { waits = 1 }
    /ld\.global\.nc/ { if (waits) after[loc]++; else before[loc]++ }
    /^}/ { flush() }
    function flush(  k) {
      if (name == "") return
      if (waits) {
        for (k in before) { out[name " " k] = 1; b[name " " k] += before[k] }
        for (k in after) { out[name " " k] = 1; a[name " " k] += after[k] }
      }
      name = ""
    }
    END { for (k in out) print k, b[k] + 0, a[k] + 0 }
  ' "$ptx" "$ptx"
done | while read -r mangled where before after; do
  # The kernel's bare name: demangled, namespaces, template arguments and parameters dropped.
  name=$(echo "$mangled" | c++filt | sed -E 's/\(anonymous namespace\):://g; s/\(.*//; s/<.*//; s/.*:://; s/^void //')
  echo "$name $where $before $after"
done | awk '{ key = $1 " " $2; b[key] += $3; a[key] += $4 } END { for (k in b) print k, b[k], a[k] }' | sort
