#!/usr/bin/env bash
# Copy the embedded model's tokenizer files (not its weights) into .gpucache/, for a GPU machine that has no
# package registry: random:* models there use this tokenizer. Run after the embedded model was converted once.
set -euo pipefail
src="${LLM_STEPS_CACHE:-$HOME/.cache/llm-serving-steps}/smollm2-135m-instruct"
dst=.gpucache/smollm2-135m-instruct
mkdir -p "$dst"
cp "$src"/tokenizer.json "$src"/tokenizer_config.json "$src"/chat_template.jinja "$dst"/
echo "copied tokenizer files to $dst"
