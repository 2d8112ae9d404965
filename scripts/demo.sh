#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job: `specula generate`
# on the embedded default family (models/: a small Gemma 4 trained on the
# Python source of Debian packages, with its assistant drafter, so speculation is on),
# streaming a continuation of a Python prompt and a summary line with the
# acceptance rate and tau. Extra arguments go to `specula generate`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
echo "building specula ..." >&2
SPECULA_TARGET=specula bash scripts/build.sh build >/dev/null
prompt=${SPECULA_PROMPT:-$'import os\nimport sys\n\n\ndef main(argv):\n    """'}
exec ./build/apps/specula generate --prompt "$prompt" --max-tokens "${SPECULA_MAX_TOKENS:-96}" "$@"
