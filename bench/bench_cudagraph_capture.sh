#!/usr/bin/env bash
# What vLLM's CUDA-graph capture costs a server start, and what limiting it to the sweep's largest
# concurrency changes in the serving figures: a Llama-3-8B-shaped model (public config, dummy weights)
# served on one GPU with vLLM's default capture sizes and with `--max-cudagraph-capture-size CAP`,
# each start's phases from its log (quantpipe's startup_phases, as the benchmark stage reads them),
# then, on the warm starts, `vllm bench serve` at concurrency 1, 16 and CAP (random 512-token prompts,
# 128 output tokens).
#
#   bench/bench_cudagraph_capture.sh TOKENIZER_DIR OUT_DIR [CAP]
#
# CAP defaults to 64. Four starts: default, capped (each compiling cold), then default and capped again
# (vLLM's compile cache warm), the last two measured under load. FlashInfer's sampler is off
# (VLLM_USE_FLASHINFER_SAMPLER=0) so that no start pays its one-time JIT build. Needs `vllm` on PATH.
set -uo pipefail
tok=$1 out=$2 cap=${3:-64}
export VLLM_USE_FLASHINFER_SAMPLER=0
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out" /tmp/qp/l8b-dummy
cp "$tok"/tokenizer.json "$tok"/tokenizer_config.json /tmp/qp/l8b-dummy/
python3 - <<'EOF'
import json
cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
           num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
           max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
           torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)
json.dump(cfg, open("/tmp/qp/l8b-dummy/config.json", "w"), indent=1)
EOF
i=0
for setting in default cap default cap; do
  i=$((i + 1))
  flags=(--load-format dummy --max-model-len 2048 --port 8321)
  [ "$setting" = cap ] && flags+=(--max-cudagraph-capture-size "$cap")
  log=$out/serve-$i-$setting.log
  t0=$(date +%s.%N)
  vllm serve /tmp/qp/l8b-dummy "${flags[@]}" >"$log" 2>&1 &
  pid=$!
  until curl -sf http://127.0.0.1:8321/health >/dev/null; do
    sleep 0.5; kill -0 $pid 2>/dev/null || { tail -30 "$log"; exit 1; }
  done
  start_s=$(python3 -c "import time; print(round(time.time() - $t0, 2))")
  PYTHONPATH=$here/pipeline/stages/benchmark python3 -c "
import json, sys
from startup import startup_phases
text = open('$log').read()
p = startup_phases(text, $start_s)
import re
p['graphs'] = {m.group(1): int(m.group(2)) for m in re.finditer(r'Capturing CUDA graphs \\(([^)]*)\\).*?\\d+/(\\d+)', text)}
p.update(start=$i, setting='$setting', cap=$cap if '$setting' == 'cap' else None)
print(json.dumps(p))" >>"$out/starts.jsonl"
  tail -1 "$out/starts.jsonl"
  [ $i -le 2 ] && { kill $pid; wait $pid 2>/dev/null; continue; }
  for c in 1 16 "$cap"; do
    n=$((c * 4)); [ $n -lt 16 ] && n=16
    vllm bench serve --model /tmp/qp/l8b-dummy --port 8321 --dataset-name random --random-input-len 512 \
      --random-output-len 128 --num-prompts $n --max-concurrency "$c" --ignore-eos --seed $i \
      --save-result --result-dir "$out" --result-filename "bench-$i-$setting-c$c.json" >"$out/bench-$i-$setting-c$c.log" 2>&1
    python3 -c "
import json; r = json.load(open('$out/bench-$i-$setting-c$c.json'))
print('$setting start $i c=$c', *(f'{k}={r[k]:.2f}' for k in ('output_throughput', 'median_ttft_ms', 'median_tpot_ms', 'p99_itl_ms')))"
  done
  kill $pid; wait $pid 2>/dev/null
done
