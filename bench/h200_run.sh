#!/usr/bin/env bash
# quantpipe on an offline H200 host, in device calls of at most 10 minutes each (the host keeps
# /tmp only while calls follow each other). The wheel bundles are carried in first, one folder per
# call, and copied to /tmp/w/{vllm,llmc,extra}; .gpu/tiny is a copy of the tiny models (.tiny/).
#
#   bench/h200_run.sh install [SHAPE...]       install the bundles, build the shaped models + LoRA
#                                              (SHAPE: llama3-8b (default), qwen25-7b)
#   bench/h200_run.sh run RECIPE [ARGS...]     quantpipe run RECIPE ARGS, results into $OUT
#   bench/h200_run.sh bench-serve ARTIFACT_DIR OUTNAME [vllm bench serve args...]
#                                              a bare `vllm serve` + `vllm bench serve` per concurrency
#                                              (QP_CONCURRENCY), to set beside the benchmark stage's figures
#   bench/h200_run.sh pipeline [SHAPE]         the shape's whole recipe on a 2-GPU host, detached (it outlives
#                                              the call): split by artifact over the GPUs, the tiny model's
#                                              validation beside it, the quantize stage against a bare oneshot
#                                              (those two with llama3-8b only; with qwen25-7b, the published
#                                              fp8 package verified and served bare instead), then the whole
#                                              recipe once more and an unchanged re-run
#   bench/h200_run.sh nightly                  vLLM's compile cache across nightly rebuilds, detached, one GPU:
#                                              bench/bench_compile_cache.py on the 8B nightly recipe, three
#                                              nights from new directories of the base model into new stage
#                                              caches, night 2 without the stable links (the control)
#   bench/h200_run.sh compile-links            the smallest GPU check of the stable serving link (minutes):
#                                              three `vllm serve` starts of the tiny model, as the benchmark
#                                              stage starts them, each from a new directory of hard links;
#                                              1 and 3 through one links directory, 2 through its own (the
#                                              control); start times and compile lines into $OUT
#   bench/h200_run.sh one-gpu                  one H200, detached: the tiny model's whole recipe (each artifact's
#                                              evaluation through its benchmark's server), its baseline's lm-eval
#                                              figures against `lm_eval --model vllm` (bench/bench_eval_agreement.py),
#                                              then the 8B shape's baseline and fp8 (merge and quantize beside the tiny
#                                              run, then evaluation + benchmark as one job per artifact, packages;
#                                              QP_ARTIFACTS=fp8,int8,gptq-w4a16,awq-w4a16 for the whole 8B recipe)
#   bench/h200_run.sh recipe [RECIPE]          one H200, detached: RECIPE (default the 8B shape's whole recipe) in one
#                                              `quantpipe run` from an empty stage cache, then its unchanged re-run;
#                                              QP_ARTIFACTS=gptq-w4a16,awq-w4a16 builds only those (`--artifacts`);
#                                              QP_STAGES=benchmark runs only those stages and what they need;
#                                              QP_WARM=1: the second run from an empty stage cache on the warm host;
#                                              QP_WARMUP=RECIPE: the first run is that lighter recipe (same shape, schemes,
#                                              engine); QP_JOBS: --jobs; QP_STAGE_TIMEOUT: minutes (default 10);
#                                              QP_THEN="ARGS": the second run adds ARGS (e.g. --gpu-memory 40GiB);
#                                              QP_RESTARTS=N: after the first run, N times every benchmark again
#                                              (`--stages benchmark --force benchmark`: fresh servers on the warm host)
#   bench/h200_run.sh collect SECONDS          wait for `pipeline`, `nightly`, `one-gpu` or `recipe` (at most SECONDS), print its
#                                              progress and put every run.json, report, stage result and log in $OUT
# Every phase prints its wall time; `run` leaves run.json, report.md/json and a log tarball in $OUT.
#
# The device calls (2 x H200; a machine is held 30 minutes at most):
#   here:  bench/gpu_bundle.sh (builds .gpu/: the wheel bundles, tokenizer, tiny models, a git archive of HEAD)
#   calls 1-6 carry .gpu/vllm/partN alone:  mkdir -p /tmp/w/vllm && cp -r .gpu/vllm/partN/. /tmp/w/vllm/
#   call 7 carries part7, llmc, extra, tok, tiny and qp: copy vllm/part7/. and llmc/part1/. and extra/. to
#          /tmp/w/{vllm,llmc,extra}, qp/. to /tmp/qp/src, then there (from /tmp/qp/src)
#          `QP_GPU_FILES=$REPO/.gpu bash bench/h200_run.sh install SHAPE && bash bench/h200_run.sh pipeline SHAPE`
#   then `bash bench/h200_run.sh collect 540` (from /tmp/qp/src) back to back until it says done: the host
#   forgets /tmp 30 s after a call, and what `pipeline` wrote with it, so issue the next collect as soon
#   as one returns. The 7 carry calls take 1-2.5 minutes (the machine's start included); the llama3-8b
#   pipeline ~22.5 minutes, the qwen25-7b one ~17.5 (docs/BENCHMARKS.md). `compile-links` needs only
#   bench/gpu_env.sh (16 s) after the carry calls, no `install`: ~5 minutes in all.
set -uo pipefail
files=${QP_GPU_FILES:-$PWD/.gpu}   # carried bundles: tok/ (tokenizer for the 8B shape), tiny/
cd "$(dirname "$0")/.."
t0=$(date +%s)
phase=$1; shift
export QUANTPIPE_CACHE=/tmp/qp/cache HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
[ -f .git_commit ] && export QUANTPIPE_GIT_COMMIT=$(cat .git_commit)  # the archive's commit (run.json records it)
stamp() { echo "$(date +%T) +$(( $(date +%s) - t0 )) s: $*"; }
use_env() {  # the stage interpreters: bench/gpu_env.sh's (/tmp/qp/env.sh), else the README's set-up (make setup)
  if [ -f /tmp/qp/env.sh ]; then
    source /tmp/qp/env.sh
    QP_PY=python3
  elif [ -x .venv/quantize/bin/python ]; then
    QP_PY=$PWD/.venv/quantize/bin/python
    export QUANTPIPE_PYTHON_SERVE=${QUANTPIPE_PYTHON_SERVE:-$PWD/.venv/serve/bin/python}
  else
    echo "no stage environments: run \`QUANTPIPE_WHEELHOUSE=DIR make setup\` (README) or bench/gpu_env.sh first" >&2
    exit 2
  fi
}
output_dir() { "$QP_PY" -c "import sys; from quantpipe.recipe import load; print(load(sys.argv[1], check_files=False).output_dir)" "$1"; }
case $phase in
install)
  bash bench/gpu_env.sh /tmp/w /tmp/qp || exit 1
  echo "install: $(( $(date +%s) - t0 )) s"
  if [ -d "$files/tiny" ]; then  # the lm-eval task YAMLs name their data files by the absolute path they were built at
    mkdir -p /tmp/qp/tiny && cp -r "$files/tiny/." /tmp/qp/tiny/
    sed -i -E 's#/[^ "]*/tasks/#/tmp/qp/tiny/tasks/#g' /tmp/qp/tiny/tasks/*.yaml
  fi
  use_env
  for shape in "${@:-llama3-8b}"; do
    [ -d /tmp/qp/models/$shape/base ] || python3 bench/make_shaped_model.py --shape $shape --tokenizer "$files/tok" --out /tmp/qp/models/$shape || exit 1
  done
  echo "model: $(( $(date +%s) - t0 )) s"
  ;;
run)
  use_env
  recipe=$1; shift
  name=$(basename "$recipe" .yaml)
  "$QP_PY" -m quantpipe run "$recipe" "$@"
  rc=$?
  echo "run rc=$rc after $(( $(date +%s) - t0 )) s"
  if [ -n "${OUT:-}" ]; then
    out=$(output_dir "$recipe")
    last=$(ls -td "$out"/runs/*/ | head -1)
    for f in run.json report.md report.json; do cp "$last/$f" "$OUT/$name-$(date +%H%M%S)-$f" 2>/dev/null; done
    tar czf "$OUT/$name-$(date +%H%M%S)-logs.tgz" -C "$last" logs run.log 2>/dev/null
  fi
  exit $rc
  ;;
bench-serve)
  # The server's flags are the recipe's engine settings; VLLM_SERVER_DEV_MODE only opens /reset_prefix_cache,
  # which is called before each run as the benchmark stage does (the runs reuse one seed, so one prompt set).
  use_env
  model=$1 name=$2; shift 2
  res=${QP_RESULTS:-${OUT:-/tmp/qp}}; mkdir -p "$res"
  VLLM_SERVER_DEV_MODE=1 PYTHONPATH=/tmp/qp/vllm:/tmp/qp/extra PATH=/tmp/qp/vllm/bin:$PATH python3 -m vllm.entrypoints.cli.main serve "$model" \
    --host 127.0.0.1 --port 8321 --max-model-len 2048 --gpu-memory-utilization 0.85 > "$res/bare-serve-$name.log" 2>&1 &
  pid=$!
  until curl -sf http://127.0.0.1:8321/health >/dev/null; do sleep 1; kill -0 $pid 2>/dev/null || { tail -30 "$res/bare-serve-$name.log"; exit 1; }; done
  echo "bare server up after $(( $(date +%s) - t0 )) s"
  rc=0
  for c in ${QP_CONCURRENCY:-1}; do
    curl -sf -X POST http://127.0.0.1:8321/reset_prefix_cache >/dev/null || echo "prefix cache not reset"
    PYTHONPATH=/tmp/qp/vllm:/tmp/qp/extra python3 -m vllm.entrypoints.cli.main bench serve --backend openai \
      --host 127.0.0.1 --port 8321 --endpoint /v1/completions --model "$model" --max-concurrency "$c" --save-result \
      --result-dir "$res" --result-filename "$name-c$c.json" "$@" || rc=$?
  done
  kill $pid; wait $pid 2>/dev/null
  echo "bench-serve rc=$rc after $(( $(date +%s) - t0 )) s"
  exit $rc
  ;;
pipeline|nightly|one-gpu|recipe)
  mkdir -p /tmp/qp/log && rm -f /tmp/qp/log/done
  case $phase in
    pipeline) drive=(_drive "${1:-llama3-8b}") ;; nightly) drive=(_nightly) ;; one-gpu) drive=(_one) ;;
    *) drive=(_recipe "${1:-bench/recipes/h200-llama3-8b-full.yaml}") ;;
  esac
  setsid nohup bash bench/h200_run.sh "${drive[@]}" > /tmp/qp/log/drive.log 2>&1 < /dev/null &
  echo "$phase started (pid $!): bench/h200_run.sh collect SECONDS to follow it"
  ;;
_nightly)
  # bench/bench_compile_cache.py on GPU 0: nights 1 and 3 through the shared links, night 2 the control.
  use_env
  stamp "start nightly (quantpipe ${QUANTPIPE_GIT_COMMIT:-?})"; nvidia-smi --query-gpu=index,name,memory.used --format=csv
  CUDA_VISIBLE_DEVICES=0 python3 bench/bench_compile_cache.py bench/recipes/h200-llama3-8b-nightly.yaml --nights 3 \
    --workdir /tmp/qp/nightly --json /tmp/qp/log/compile-cache-nights.json > /tmp/qp/log/nightly.log 2>&1
  stamp "nightly rc=$?"; touch /tmp/qp/log/done
  ;;
_one)
  use_env
  R=bench/recipes/h200-llama3-8b-full.yaml T=bench/recipes/h200-tiny.yaml L=/tmp/qp/log
  stamp "start one-gpu (quantpipe ${QUANTPIPE_GIT_COMMIT:-?})"; nproc; free -g; nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv
  # Q: the 8B merge and fp8 quantization (CPU work and < 3 GiB of GPU) beside T, whose engines take 0.3 of the GPU.
  A=${QP_ARTIFACTS:-fp8}
  ( "$QP_PY" -m quantpipe run --stage-timeout 8 $R --stages quantize --artifacts $A > $L/Q.log 2>&1; stamp "Q rc=$?" ) &
  q=$!
  "$QP_PY" -m quantpipe run --stage-timeout 8 $T > $L/T.log 2>&1; stamp "T (the tiny recipe) rc=$?"
  ev=$(dirname "$(grep -l /tmp/qp/tiny/tasks /tmp/qp/cache/stages/evaluate/baseline/*/out/evaluation.json | head -1)")
  $QUANTPIPE_PYTHON_SERVE bench/bench_eval_agreement.py "$ev" --json $L/eval-agreement.json > $L/E.log 2>&1; stamp "E (lm_eval --model vllm) rc=$?"
  wait $q
  "$QP_PY" -m quantpipe run --stage-timeout 8 $R --artifacts $A > $L/A.log 2>&1; stamp "A (8B baseline + $A) rc=$?"
  stamp done; touch $L/done
  ;;
_recipe)
  use_env
  R=$1 L=/tmp/qp/log
  stamp "start recipe $R (quantpipe ${QUANTPIPE_GIT_COMMIT:-?})"; nproc; free -g; nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv
  df -h /tmp
  only=(${QP_ARTIFACTS:+--artifacts $QP_ARTIFACTS} ${QP_STAGES:+--stages $QP_STAGES} ${QP_JOBS:+--jobs $QP_JOBS})
  limit=${QP_STAGE_TIMEOUT:-10}  # minutes
  if [ -n "${QP_WARMUP:-}" ]; then  # R1 warms the host with a lighter recipe of the same shape, schemes and engine
    "$QP_PY" -m quantpipe run --stage-timeout $limit $QP_WARMUP "${only[@]}" > $L/R1.log 2>&1; rc=$?; stamp "R1 (warm-up $QP_WARMUP) rc=$rc"
  else
    "$QP_PY" -m quantpipe run --stage-timeout $limit $R "${only[@]}" > $L/R1.log 2>&1; rc=$?; stamp "R1 (${QP_ARTIFACTS:-the whole recipe}, empty stage cache) rc=$rc"
  fi
  if [ $rc = 2 ]; then  # refused before anything ran (pre-flight: disk): the artifacts that fit
    tail -5 $L/R1.log; "$QP_PY" -m quantpipe run --stage-timeout 10 $R --artifacts ${QP_FALLBACK:-fp8,gptq-w4a16,awq-w4a16} > $L/R1b.log 2>&1
    stamp "R1b (--artifacts ${QP_FALLBACK:-fp8,gptq-w4a16,awq-w4a16}) rc=$?"
  fi
  for i in $(seq 1 "${QP_RESTARTS:-0}"); do  # the spread between server starts on one host, beside each run's intervals
    "$QP_PY" -m quantpipe run --stage-timeout $limit $R "${only[@]}" --stages benchmark --force benchmark > $L/S$i.log 2>&1
    stamp "S$i (every benchmark again from fresh servers) rc=$?"
  done
  if [ -n "${QP_WARM:-}" ]; then  # the nightly case: an empty stage cache on a host whose compile and kernel caches are warm
    mkdir -p $L/R1-cache && (cd "$QUANTPIPE_CACHE" && find . -type f \( -name '*.json' -o -name '*.log' \) -size -8M | tar cf - -T - | tar xf - -C $L/R1-cache)
    rm -rf "$QUANTPIPE_CACHE"; stamp "stage cache emptied (its records in $L/R1-cache)"
    "$QP_PY" -m quantpipe run --stage-timeout $limit $R "${only[@]}" > $L/R2.log 2>&1; stamp "R2 (empty stage cache, warm host) rc=$?"
  else
    read -r -a then <<<"${QP_THEN:-}"  # e.g. "--gpu-memory 40GiB --artifacts fp8 --force evaluate,benchmark"
    "$QP_PY" -m quantpipe run --stage-timeout $limit $R "${only[@]}" "${then[@]}" > $L/R2.log 2>&1
    stamp "R2 (${QP_THEN:-re-run, unchanged}) rc=$?"
  fi
  stamp done; touch $L/done
  ;;
_drive)
  # On 2 x H200 with llama3-8b (docs/BENCHMARKS.md): A and B end ~20 min after the start, the
  # quantize-overhead pair takes ~2.6 min more, the whole recipe ~7 s and its re-run ~2 s. The tiny
  # model's validation and the quantize-overhead pair run with llama3-8b only.
  shape=$1
  case $shape in
    llama3-8b) R=bench/recipes/h200-llama3-8b-full.yaml ;;
    qwen25-7b) R=bench/recipes/h200-qwen25-7b.yaml ;;
    *) echo "unknown shape $shape (llama3-8b, qwen25-7b)" >&2; exit 2 ;;
  esac
  use_env
  R1=${R%.yaml}-gpu1.yaml L=/tmp/qp/log
  sed "s#^output_dir: \(.*\)#output_dir: \1-gpu1#" $R > $R1  # a second output dir, the same cache
  stamp "start $shape (quantpipe ${QUANTPIPE_GIT_COMMIT:-?})"; df -h /tmp; nproc; free -g; nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv
  # GPU 0: merge, the baseline, fp8 and awq, then the quantize stage against a bare oneshot (GPTQ, the
  # recipe's calibration settings). GPU 1: quantize int8, gptq and awq meanwhile, then evaluate, benchmark
  # and package int8 and gptq; the tiny model's validation shares GPU 1 during those quantizations (its
  # engine takes 0.25 of the GPU, the 8B quantizations at most 3.7 GiB). The tiny run's engines are the
  # host's first and run without FlashInfer's sampler: the control for the first engine's ~90 s warm-up.
  ( export CUDA_VISIBLE_DEVICES=0
    "$QP_PY" -m quantpipe run --stage-timeout 8 $R --artifacts fp8,awq-w4a16 > $L/A.log 2>&1; stamp "A rc=$?"
    if [ $shape != llama3-8b ]; then
      # The published fp8 package as a user gets it: verified, then served by a bare `vllm serve` and
      # measured by `vllm bench serve` with the recipe's workload, on the GPU A measured it on. (vLLM's
      # compile cache is keyed by the model's path: a server of the package's path compiles again.)
      pkg=$(output_dir $R)/packages/fp8
      "$QP_PY" -m quantpipe verify "$pkg" > $L/verify.log 2>&1; stamp "verify rc=$?"
      QP_RESULTS=$L/bare QP_CONCURRENCY="1 16 64" bash bench/h200_run.sh bench-serve "$pkg" pkg-fp8 --dataset-name random \
        --random-input-len 512 --random-output-len 128 --random-range-ratio 0.0 --num-prompts 64 --request-rate inf \
        --ignore-eos --temperature 0 --seed 0 > $L/bare.log 2>&1; stamp "bare bench-serve rc=$?"
      exit 0
    fi
    python3 bench/bench_quantize.py --model /tmp/qp/models/$shape/base --calibration calibration/tiny-mix.jsonl \
      --method gptq --num-samples 128 --max-seq-len 512 --repeats 1 --no-warmup > $L/bq.log 2>&1; stamp "bench_quantize rc=$?" ) &
  a=$!
  ( export CUDA_VISIBLE_DEVICES=1
    t=
    if [ $shape = llama3-8b ]; then
      VLLM_USE_FLASHINFER_SAMPLER=0 "$QP_PY" -m quantpipe run --stage-timeout 8 bench/recipes/h200-tiny.yaml --stages evaluate > $L/T.log 2>&1 &
      t=$!
    fi
    "$QP_PY" -m quantpipe run --stage-timeout 8 $R1 --stages quantize --artifacts int8,gptq-w4a16,awq-w4a16 > $L/B1.log 2>&1; stamp "B1 rc=$?"
    [ -z "$t" ] || { wait $t; stamp "T rc=$?"; }  # B2's engines take 0.9 of GPU 1: the tiny engines must be gone first
    "$QP_PY" -m quantpipe run --stage-timeout 8 $R1 --stages evaluate,benchmark,package --artifacts int8,gptq-w4a16 > $L/B2.log 2>&1; stamp "B2 rc=$?" ) &
  b=$!
  wait $a $b
  # The whole recipe once more: every stage is cached now but int8's and gptq's publishing into this
  # output directory; one run.json and report for the whole recipe. Then the unchanged re-run.
  CUDA_VISIBLE_DEVICES=0 "$QP_PY" -m quantpipe run --stage-timeout 8 $R > $L/C1.log 2>&1; stamp "C1 (the whole recipe) rc=$?"
  CUDA_VISIBLE_DEVICES=0 "$QP_PY" -m quantpipe run --stage-timeout 8 $R > $L/C2.log 2>&1; stamp "C2 (re-run, unchanged) rc=$?"
  ls -la --time-style=+%T ~/.cache/flashinfer ~/.cache/flashinfer/* 2>&1 | head -40; du -sh ~/.cache/* /tmp/qp/* 2>&1; df -h /tmp
  stamp done; touch $L/done
  ;;
compile-links)
  use_env
  VLLM_USE_FLASHINFER_SAMPLER=0 python3 - "${OUT:-/tmp/qp/links-check}" <<'PY'
import json, os, re, shutil, sys
from pathlib import Path
from quantpipe.server import Server
from quantpipe.serving_links import stable_path
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
rows = []
for n, links in ((1, "links"), (2, "links-control"), (3, "links")):
    d = Path(f"/tmp/qp/night{n}/llama"); shutil.rmtree(d.parent, ignore_errors=True); d.parent.mkdir(parents=True)
    shutil.copytree("/tmp/qp/tiny/llama", d, copy_function=os.link)
    os.environ["QUANTPIPE_SERVING_LINKS"] = f"/tmp/qp/{links}"
    with stable_path(d) as served:
        srv = Server(served, ["--max-model-len", "1024", "--gpu-memory-utilization", "0.3"], log_path=out / f"night{n}-server.log",
                     python=os.environ["QUANTPIPE_PYTHON_SERVE"], gpu=True)
        with srv:
            srv.completion("Hello", max_tokens=4)
    log = (out / f"night{n}-server.log").read_text(errors="replace")
    lines = [ln[:220] for ln in log.splitlines() if re.search(r"Directly load|AOT compiled|torch.compile take|Compiling|Dynamo bytecode|init engine", ln)]
    rows.append({"night": n, "links": links, "served": str(served), "server_start_s": round(srv.start_s, 1), "compile_log": lines})
    print(json.dumps(rows[-1], indent=1), flush=True)
    (out / "compile-links.json").write_text(json.dumps(rows, indent=1))
PY
  ;;
collect)
  end=$(( t0 + ${1:-540} ))
  while [ ! -e /tmp/qp/log/done ] && [ "$(date +%s)" -lt "$end" ]; do sleep 15; done
  for f in /tmp/qp/log/*.log; do echo "== $f"; grep -E "✓|x |FAILED|rc=|run |skipped|Error|error|up after" "$f" | tail -n 40; done
  nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader
  cd /tmp/qp && find log out cache nightly -type f \( -name '*.json' -o -name '*.jsonl' -o -name '*.log' -o -name '*.md' -o -name '*.html' \
      -o -name '*.txt' -o -name '*.yaml' -o -name '*.svg' -o -name '*.png' -o -name '*.sh' \) ! -name 'tokenizer*' -size -8M 2>/dev/null \
    | tar czf "$OUT/results.tgz" -T - && ls -la "$OUT"
  ;;
*) echo "usage: $0 install | run RECIPE [ARGS] | bench-serve MODEL NAME [ARGS] | pipeline | nightly | one-gpu | recipe [RECIPE] | compile-links | collect SECONDS" >&2; exit 2 ;;
esac
