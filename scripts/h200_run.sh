#!/usr/bin/env bash
# quantpipe on an offline H200 host, in device calls of at most 10 minutes each (the host keeps
# /tmp only while calls follow each other). The wheel bundles are carried in first, one folder per
# call, and copied to /tmp/w/{vllm,llmc,extra}; .gpu/tiny is a copy of the tiny models (.tiny/).
#
#   scripts/h200_run.sh install [SHAPE...]      install the bundles, build the shaped models + LoRA
#                                               (SHAPE: llama3-8b (default), qwen25-7b)
#   scripts/h200_run.sh run RECIPE [ARGS...]    quantpipe run RECIPE ARGS, results into $OUT
#   scripts/h200_run.sh bench-serve ARTIFACT_DIR OUTNAME [vllm bench serve args...]
#                                               a bare `vllm serve` + `vllm bench serve`, to set
#                                               beside the benchmark stage's figures
# Every phase prints its wall time; `run` leaves run.json, report.md/json and a log tarball in $OUT.
set -uo pipefail
files=${QP_GPU_FILES:-$PWD/.gpu}   # carried bundles: tok/ (tokenizer for the 8B shape), tiny/
cd "$(dirname "$0")/.."
t0=$(date +%s)
phase=$1; shift
export QUANTPIPE_CACHE=/tmp/qp/cache HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
case $phase in
install)
  bash scripts/gpu_env.sh /tmp/w /tmp/qp || exit 1
  echo "install: $(( $(date +%s) - t0 )) s"
  if [ -d "$files/tiny" ]; then  # the lm-eval task YAMLs name their data files by the absolute path they were built at
    mkdir -p /tmp/qp/tiny && cp -r "$files/tiny/." /tmp/qp/tiny/
    sed -i -E 's#/[^ "]*/tasks/#/tmp/qp/tiny/tasks/#g' /tmp/qp/tiny/tasks/*.yaml
  fi
  source /tmp/qp/env.sh
  for shape in "${@:-llama3-8b}"; do
    [ -d /tmp/qp/models/$shape/base ] || python3 scripts/make_shaped_model.py --shape $shape --tokenizer "$files/tok" --out /tmp/qp/models/$shape || exit 1
  done
  echo "model: $(( $(date +%s) - t0 )) s"
  ;;
run)
  source /tmp/qp/env.sh
  recipe=$1; shift
  name=$(basename "$recipe" .yaml)
  python3 -m quantpipe run "$recipe" "$@"
  rc=$?
  echo "run rc=$rc after $(( $(date +%s) - t0 )) s"
  if [ -n "${OUT:-}" ]; then
    out=$(python3 -c "import sys; from quantpipe.recipe import load; print(load(sys.argv[1], check_files=False).output_dir)" "$recipe")
    last=$(ls -td "$out"/runs/*/ | head -1)
    for f in run.json report.md report.json; do cp "$last/$f" "$OUT/$name-$(date +%H%M%S)-$f" 2>/dev/null; done
    tar czf "$OUT/$name-$(date +%H%M%S)-logs.tgz" -C "$last" logs run.log 2>/dev/null
  fi
  exit $rc
  ;;
bench-serve)
  source /tmp/qp/env.sh
  model=$1 name=$2; shift 2
  PYTHONPATH=/tmp/qp/vllm:/tmp/qp/extra PATH=/tmp/qp/vllm/bin:$PATH python3 -m vllm.entrypoints.cli.main serve "$model" \
    --host 127.0.0.1 --port 8321 --max-model-len 2048 --gpu-memory-utilization 0.85 > /tmp/qp/bare-serve.log 2>&1 &
  pid=$!
  until curl -sf http://127.0.0.1:8321/health >/dev/null; do sleep 1; kill -0 $pid 2>/dev/null || { tail -30 /tmp/qp/bare-serve.log; exit 1; }; done
  echo "bare server up after $(( $(date +%s) - t0 )) s"
  PYTHONPATH=/tmp/qp/vllm:/tmp/qp/extra python3 -m vllm.entrypoints.cli.main bench serve --backend openai \
    --host 127.0.0.1 --port 8321 --endpoint /v1/completions --model "$model" --save-result \
    --result-dir "${OUT:-/tmp/qp}" --result-filename "$name.json" "$@"
  rc=$?
  kill $pid; wait $pid 2>/dev/null
  echo "bench-serve rc=$rc after $(( $(date +%s) - t0 )) s"
  exit $rc
  ;;
*) echo "usage: $0 install | run RECIPE [ARGS] | bench-serve MODEL NAME [ARGS]" >&2; exit 2 ;;
esac
