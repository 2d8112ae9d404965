#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job: `specula generate`
# on the default model. Until the embedded default family ships (models/), the
# default is the tiny Gemma 4 (E2B-shaped) parity fixture in tests/golden/e2b_like.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
bash scripts/build.sh build >/dev/null
model=${SPECULA_MODEL:-tests/golden/e2b_like}
exec ./build/apps/specula generate --model "$model" --prompt-ids "${SPECULA_PROMPT_IDS:-2,17,42,99,7,23,64,5}" \
  --max-tokens "${SPECULA_MAX_TOKENS:-32}" "$@"
