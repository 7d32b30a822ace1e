#!/usr/bin/env bash
# Nightly builds: run every recipe given, compare each run with that recipe's last good run, keep the reports.
#
#   scripts/nightly.sh recipes/demo.yaml [more recipes...]
#   crontab:  30 2 * * *  /path/to/quantpipe/scripts/nightly.sh /path/to/recipes/*.yaml >> /var/log/quantpipe-nightly.log 2>&1
#
# Each run writes its report (report.html/.md/.json) into <output_dir>/runs/<run_id>/; this script adds
# compare.txt and compare.json there (the comparison with the last good run), refreshes
# <output_dir>/history.html and history.json (`quantpipe history`: every artifact's figures across the nights,
# regressions flagged) and prints a summary.
# Exit status: 0 when every run completed, passed its gates and showed no regression; 3 when a gate failed or a
# comparison found a regression; 1 when a run failed; 2 for bad usage. A first run (no last good run yet) is not
# a failure. Runs queue behind one another (--wait) if cron starts a night while the last one still runs.
#
# Environment: QUANTPIPE (the command, default: this checkout's .venv/quantize/bin/quantpipe, else `quantpipe`
# on PATH), QUANTPIPE_NIGHTLY_ARGS (extra `quantpipe run` arguments, e.g. "--force benchmark" or
# "--stage-timeout 120" so that a hung stage cannot hold the night), QUANTPIPE_MLFLOW (a tracking server URI: each
# run is logged there, and afterwards every night a server that was down has missed is pushed; without it a
# recipe's own `tracking.mlflow` still applies to its run), QUANTPIPE_NIGHTLY_KEEP (after each run that went to its
# end, exit 0 or 3, `quantpipe cache prune --keep-runs N` on that run's stage cache: the entries of each output
# directory's last N runs, of its published packages and of running runs stay; default 3, 0 or off: no pruning).
set -u -o pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ $# -eq 0 ]]; then
  echo "usage: $0 RECIPE.yaml [RECIPE.yaml ...]" >&2
  exit 2
fi
if [[ -n "${QUANTPIPE:-}" ]]; then
  read -r -a qp <<<"$QUANTPIPE"
elif [[ -x "$here/.venv/quantize/bin/quantpipe" ]]; then
  qp=("$here/.venv/quantize/bin/quantpipe")
elif command -v quantpipe >/dev/null; then
  qp=(quantpipe)
else
  echo "nightly: no quantpipe command; set QUANTPIPE or run scripts/setup_envs.sh" >&2
  exit 2
fi
keep="${QUANTPIPE_NIGHTLY_KEEP:-3}"
if [[ "$keep" == off ]]; then keep=0; fi
if ! [[ "$keep" =~ ^[0-9]+$ ]]; then
  echo "nightly: QUANTPIPE_NIGHTLY_KEEP=$keep is not a number of runs; set it to N (keep each output directory's last N runs' cache entries) or to 0 or off (no pruning)" >&2
  exit 2
fi
read -r -a extra <<<"${QUANTPIPE_NIGHTLY_ARGS:-}"
mlflow="${QUANTPIPE_MLFLOW:-}"
if [[ -n "$mlflow" ]]; then extra+=(--mlflow "$mlflow"); fi
# A Python for reading JSON: the one beside the quantpipe command, else the system's.
py="$(dirname "$(command -v "${qp[0]}" || echo /nonexistent)")/python"
[[ -x "$py" ]] || py=python3

status=0
summary=()
worst() {  # keep the most serious exit status: 1 (something failed) over 3 (gate failed / regression) over 0
  if (( $1 == 0 )); then return; fi
  if (( $1 != 3 )); then status=1; elif (( status == 0 )); then status=3; fi
}

for recipe in "$@"; do
  echo "=== $(date -u +%FT%TZ) nightly: $recipe"
  # The recipe's output directory, as the runner resolves it (relative to the recipe file).
  if ! out_dir="$("${qp[@]}" check "$recipe" 2>/dev/null | "$py" -c 'import json,sys; print(json.load(sys.stdin)["output_dir"])')"; then
    echo "nightly: $recipe is not a valid recipe (see: ${qp[*]} check $recipe)" >&2
    summary+=("$recipe: INVALID RECIPE")
    worst 1
    continue
  fi
  index="$out_dir/runs/index.jsonl"
  before=$( [[ -f "$index" ]] && wc -l <"$index" || echo 0 )
  "${qp[@]}" run "$recipe" --wait ${extra[@]+"${extra[@]}"}
  rc=$?
  # The run this invocation appended to the index (another run may have appended meanwhile: match the recipe).
  run_dir="$("$py" - "$index" "$before" "$recipe" <<'PY'
import json, os, sys
index, before, recipe = sys.argv[1], int(sys.argv[2]), os.path.realpath(sys.argv[3])
try:
    lines = open(index).read().splitlines()[before:]
except OSError:
    lines = []
runs = []
for line in lines:
    try:
        runs.append(json.loads(line))
    except ValueError:
        pass
# runs of this recipe file appended since we started (another recipe may share the output directory)
mine = []
for r in runs:
    try:
        path = json.load(open(os.path.join(r["run_dir"], "run.json"))).get("recipe_path")
    except (OSError, ValueError, KeyError, TypeError):
        path = None
    if path is None or os.path.realpath(path) == recipe:
        mine.append(r)
print(mine[-1]["run_dir"] if mine else "")
PY
)"
  if [[ -z "$run_dir" ]]; then
    echo "nightly: $recipe: the run left no record in $index (exit $rc)" >&2
    summary+=("$recipe: NO RUN RECORD (exit $rc)")
    worst 1
    continue
  fi
  case $rc in
    0) verdict="ok" ;;
    3) verdict="GATE FAILED" ;;
    *) verdict="FAILED (exit $rc)" ;;
  esac
  worst "$rc"
  "${qp[@]}" compare "$run_dir" --against last-good >"$run_dir/compare.txt" 2>&1
  crc=$?
  "${qp[@]}" compare "$run_dir" --against last-good --json >"$run_dir/compare.json" 2>/dev/null || true
  cat "$run_dir/compare.txt"
  case $crc in
    0) cmp="no regression" ;;
    3) cmp="REGRESSION"; worst 3 ;;
    2) cmp="not compared: $(tail -n 1 "$run_dir/compare.txt")" ;;
    *) cmp="compare failed (exit $crc)"; worst 1 ;;
  esac
  if "${qp[@]}" history "$out_dir" >"$run_dir/history.txt" 2>&1; then
    hist="history $out_dir/history.html"
  else
    hist="history not written: $(tail -n 1 "$run_dir/history.txt")"
  fi
  if [[ -n "$mlflow" ]] && ! "${qp[@]}" history "$out_dir" --push-mlflow "$mlflow" >>"$run_dir/history.txt" 2>&1; then
    hist="$hist; MLflow push failed: $(tail -n 1 "$run_dir/history.txt") (the next night pushes it)"
  fi
  pruned=""
  if (( keep > 0 )) && (( rc == 0 || rc == 3 )); then
    # the stage cache this run used, as its record names it
    cache_dir="$("$py" -c 'import json,sys; print(json.load(open(sys.argv[1]))["cache_dir"])' "$run_dir/run.json" 2>/dev/null)"
    if [[ -n "$cache_dir" ]] && "${qp[@]}" cache prune --keep-runs "$keep" --cache "$cache_dir" >"$run_dir/prune.txt" 2>&1; then
      pruned="; cache $(head -n 1 "$run_dir/prune.txt")"
    else
      pruned="; CACHE PRUNE FAILED: $(tail -n 1 "$run_dir/prune.txt" 2>/dev/null)"
      worst 1
    fi
  fi
  summary+=("$recipe: run $verdict; $cmp; report $run_dir/report.html; $hist$pruned")
done

echo "=== nightly summary"
printf '  %s\n' "${summary[@]}"
exit "$status"
