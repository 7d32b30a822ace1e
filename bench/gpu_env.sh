#!/usr/bin/env bash
# On an offline GPU host (python3 with torch + transformers preinstalled, no package index): install
# the carried wheel bundles into separate target folders and write the two stage interpreters.
#
#   bench/gpu_env.sh WHEELS_DIR [PREFIX]        (PREFIX default /tmp/qp)
#   source PREFIX/env.sh                        # exports QUANTPIPE_PYTHON_QUANTIZE/SERVE, PYTHONPATH for the CLI
#
# WHEELS_DIR holds vllm/ (../shared/gpu/vllm-0.26.0.txt, bundled by ../shared/gpu/bundle.sh),
# llmc/ (llmcompressor-0.14.0.1.txt) and extra/ (bench/gpu/extra.txt: lm-eval and what it needs).
# llm-compressor 0.14 pins compressed-tensors 0.19 and vLLM 0.26 pins 0.17: they never share a
# PYTHONPATH. quantpipe itself needs only what the host has plus pydantic (in the llmc bundle).
set -euo pipefail
wheels=$1 prefix=${2:-/tmp/qp}
mkdir -p "$prefix/bin"
inst() {  # inst SRC TARGET
  local src=$1 target=$2
  for first in "$src"/*.piece00; do
    [ -e "$first" ] || break
    whl=${first%.piece00}
    cat "$whl".piece* > "$whl" && rm "$whl".piece*
  done
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "$src"/*.whl
  echo "installed $(ls "$src"/*.whl | wc -l) wheels into $target"
}
[ -d "$prefix/vllm/vllm" ] || inst "$wheels/vllm" "$prefix/vllm"
[ -d "$prefix/llmc/llmcompressor" ] || inst "$wheels/llmc" "$prefix/llmc"
if [ -d "$wheels/extra" ] && [ ! -d "$prefix/extra/lm_eval" ]; then inst "$wheels/extra" "$prefix/extra"; fi
repo=$(cd "$(dirname "$0")/.." && pwd)
[ -d "$prefix/cli/quantpipe" ] || python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$prefix/cli" "$repo" >/dev/null
cat > "$prefix/bin/python-quantize" <<EOF
#!/bin/sh
PYTHONPATH=$prefix/llmc:$prefix/extra exec python3 "\$@"
EOF
cat > "$prefix/bin/python-serve" <<EOF
#!/bin/sh
PYTHONPATH=$prefix/vllm:$prefix/extra PATH=$prefix/vllm/bin:\$PATH exec python3 "\$@"
EOF
chmod +x "$prefix/bin/python-quantize" "$prefix/bin/python-serve"
cat > "$prefix/env.sh" <<EOF
export QUANTPIPE_PYTHON_QUANTIZE=$prefix/bin/python-quantize
export QUANTPIPE_PYTHON_SERVE=$prefix/bin/python-serve
export PYTHONPATH=$prefix/cli:$prefix/llmc:$prefix/extra
EOF
echo "wrote $prefix/env.sh"
