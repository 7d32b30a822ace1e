#!/usr/bin/env bash
# Build .gpu/, everything bench/h200_run.sh needs carried to an offline GPU host, from scratch:
#   vllm/ llmc/ extra/   wheel bundles in carry folders of <= 56 MiB (../shared/gpu/bundle.sh)
#   tok/                 the tiny models' tokenizer, for the shaped 8B / 7B models
#   tiny/                the tiny trained Llama, its LoRA, data and lm-eval tasks (make tiny)
#   qp/                  a `git archive` of HEAD, with .git_commit
#
#   bench/gpu_bundle.sh [SHARED_GPU_DIR]        (default ../shared/gpu; needs pip and network to PyPI here)
# Re-run it after every commit that should travel (qp/ only changes then; the wheels are kept).
set -euo pipefail
cd "$(dirname "$0")/.."
shared=${1:-../shared/gpu}
[ -e .tiny/llama/config.json ] || { echo "no .tiny: run \`make tiny\` first" >&2; exit 2; }
[ -d .gpu/vllm/part1 ] || bash "$shared/bundle.sh" "$shared/vllm-0.26.0.txt" .gpu/vllm
[ -d .gpu/llmc/part1 ] || bash "$shared/bundle.sh" "$shared/llmcompressor-0.14.0.1.txt" .gpu/llmc
# extra/ is one folder (lm-eval and what it needs, ~13 MB). Python 3.12 wheels where PyPI has them;
# rouge_score is an sdist only, built here into a pure-Python wheel.
if [ ! -e .gpu/extra/lm_eval-0.4.13-py3-none-any.whl ] || [ bench/gpu/extra.txt -nt .gpu/extra ]; then
  tmp=$(mktemp -d)
  grep -v -E '^\s*(#|$)' bench/gpu/extra.txt | while read -r req; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform any \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$tmp" "$req" 2>/dev/null \
      || python3 -m pip wheel -q --no-deps -w "$tmp" "$req"
  done
  rm -rf .gpu/extra && mkdir -p .gpu/extra && mv "$tmp"/*.whl .gpu/extra/ && rm -rf "$tmp"
fi
rm -rf .gpu/tok .gpu/tiny && mkdir -p .gpu/tok .gpu/tiny
cp .tiny/llama/{tokenizer.json,tokenizer_config.json,chat_template.jinja} .gpu/tok/
for d in llama llama-lora data tasks; do cp -r ".tiny/$d" .gpu/tiny/; done
rm -rf .gpu/qp && mkdir -p .gpu/qp && git archive HEAD | tar -x -C .gpu/qp && git rev-parse HEAD > .gpu/qp/.git_commit
du -sm .gpu/* .gpu/vllm/* | sort -k2
