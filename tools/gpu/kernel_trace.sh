#!/usr/bin/env bash
# Runs a command with tools/gpu/kernel_trace.cpp injected (on the GPU machine:
# it builds the library against the installed CUPTI), writes the kernel CSV to
# $TRACE_OUT and prints tools/gpu/kernel_trace.py's breakdown. Example:
#   TRACE_OUT=$OUT/trace.csv bash tools/gpu/kernel_trace.sh \
#     build-gpu/apps/specula bench --device cuda --random-weights 31b --micro --batch 1 --reps 5
set -euo pipefail
TRACE_OUT=${TRACE_OUT:-kernel_trace.csv}
header=$(find /usr/local/cuda*/ -name cupti_activity.h 2>/dev/null | head -1)
library=$(find /usr/local/cuda*/ -name 'libcupti.so' 2>/dev/null | head -1)
if [[ -z $header || -z $library ]]; then
  echo "kernel_trace: no CUPTI headers or library under /usr/local/cuda*" >&2
  exit 1
fi
record=$(grep -o "CUpti_ActivityKernel[0-9]*" "$header" | sort -V | tail -1)
lib=$(mktemp -d)/libkernel_trace.so
g++ -O2 -shared -fPIC -DKERNEL_RECORD="$record" -I"$(dirname "$header")" \
  "$(dirname "$0")/kernel_trace.cpp" -o "$lib" -L"$(dirname "$library")" -lcupti \
  -Wl,-rpath,"$(dirname "$library")"
TRACE_OUT=$TRACE_OUT CUDA_INJECTION64_PATH=$lib "$@"
python3 "$(dirname "$0")/kernel_trace.py" "$TRACE_OUT"
