#!/usr/bin/env bash
# On the H200 host, after the wheel bundles were copied to /tmp/w/{vllm,llmc,extra}:
#   scripts/h200_run.sh [quantpipe run args...]
# installs them (scripts/gpu_env.sh), builds the 8B-shaped model, runs recipes/h200-llama3-8b.yaml
# and leaves run.json, reports and logs in $OUT (when set).
set -uo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
bash scripts/gpu_env.sh /tmp/w /tmp/qp || exit 1
source /tmp/qp/env.sh
echo "install: $(( $(date +%s) - t0 )) s"
python3 scripts/make_shaped_model.py --shape llama3-8b --tokenizer .gpu/tok --out /tmp/qp/models/llama3-8b || exit 1
echo "model: $(( $(date +%s) - t0 )) s"
export QUANTPIPE_CACHE=/tmp/qp/cache HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m quantpipe run recipes/h200-llama3-8b.yaml "$@"
rc=$?
echo "run rc=$rc after $(( $(date +%s) - t0 )) s"
if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/h200.tgz" -C /tmp/qp/out h200-llama3-8b/runs 2>/dev/null
fi
exit $rc
