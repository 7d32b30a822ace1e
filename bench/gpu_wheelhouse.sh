#!/usr/bin/env bash
# The offline H200 host's wheelhouse, carried there in folders of at most 56 MiB (what one device call of this
# workplace carries), and quantpipe's own set-up from it there. The product's set-up path is
# `QUANTPIPE_WHEELHOUSE=DIR make setup` with DIR from scripts/wheelhouse.sh; this only cuts DIR up and glues it back.
#
#   bench/gpu_wheelhouse.sh build [OUT]      here, with the index: the wheels the H200 image lacks
#                                            (scripts/wheelhouse.sh --have bench/gpu/h200-freeze.txt OUT/wheels),
#                                            packed into OUT/part1..N (OUT default .gpu/wh)
#   bench/gpu_wheelhouse.sh pack WHEELS OUT  only the packing: wheels over 56 MiB split into NAME.whl.pieceNN,
#                                            first-fit, largest first, into OUT/part1..N
#   bench/gpu_wheelhouse.sh unpack DIR       on the host, once every part's files are in DIR: pieces back into wheels
#   bench/gpu_wheelhouse.sh setup DIR        on the host: unpack DIR, then `QUANTPIPE_WHEELHOUSE=DIR make setup`
#
# Device calls, one part each, back to back (the host forgets /tmp 30 s after a call when no other follows):
#   carry [".gpu/wh/partK"], command: mkdir -p /tmp/wh && cp -r .gpu/wh/partK/. /tmp/wh/
#   the last one also: bash bench/gpu_wheelhouse.sh setup /tmp/wh && .venv/quantize/bin/quantpipe doctor
# bench/gpu/h200-freeze.txt is `python3 -m pip list --format=freeze` on that host (Python 3.12.3, torch
# 2.11.0+cu130 in /opt/torch/.venv), 2026-12-01: what it has is reused, not carried.
set -euo pipefail
cd "$(dirname "$0")/.."
limit=$((56 * 1024 * 1024))

pack() {  # pack WHEELS OUT
  local src=$1 out=$2 pieces n=0 size path placed i
  [ -n "$(find "$src" -maxdepth 1 -name '*.whl' -print -quit)" ] || { echo "no wheels in $src" >&2; exit 2; }
  rm -rf "$out"/part* && mkdir -p "$out"
  pieces=$(mktemp -d)
  for f in "$src"/*.whl; do
    if [ "$(stat -c %s "$f")" -gt "$limit" ]; then split -b "$limit" -d -a 2 "$f" "$pieces/$(basename "$f").piece"; else cp "$f" "$pieces/"; fi
  done
  declare -A used
  while read -r size path; do
    placed=""
    for ((i = 1; i <= n; i++)); do
      if [ $((used[$i] + size)) -le "$limit" ]; then placed=$i; break; fi
    done
    if [ -z "$placed" ]; then n=$((n + 1)); placed=$n; used[$n]=0; mkdir -p "$out/part$n"; fi
    mv "$path" "$out/part$placed/"
    used[$placed]=$((used[$placed] + size))
  done < <(find "$pieces" -type f -printf '%s %p\n' | sort -rn)
  rm -rf "$pieces"
  du -sh "$out"/part* | sed 's/^/  /'
  echo "$n carry folders in $out ($(find "$src" -maxdepth 1 -name '*.whl' | wc -l) wheels, $(du -sh "$src" | cut -f1))"
}

unpack() {  # unpack DIR
  local dir=$1 first whl
  for first in "$dir"/*.piece00; do
    [ -e "$first" ] || break
    whl=${first%.piece00}
    cat "$whl".piece* > "$whl.tmp" && mv "$whl.tmp" "$whl" && rm "$whl".piece*
  done
  python3 - "$dir" <<'PY'
import sys, zipfile, pathlib
bad = [w.name for w in pathlib.Path(sys.argv[1]).glob("*.whl") if zipfile.ZipFile(w).testzip() is not None]
sys.exit(f"damaged wheels (a piece missing?): {bad}" if bad else 0)
PY
  echo "$(find "$dir" -maxdepth 1 -name '*.whl' | wc -l) wheels in $dir"
}

case ${1:-} in
  build)
    out=${2:-.gpu/wh}
    bash scripts/wheelhouse.sh --have bench/gpu/h200-freeze.txt "$out/wheels"
    python3 - "$out/wheels" <<'PY'  # drop wheels of earlier builds that no lock pins now: they would be carried for nothing
import sys
from pathlib import Path
sys.path.insert(0, "scripts")
import locks
want = {(locks.norm(p.split("==")[0]), p.split("==")[1]) for lock in ("serve", "quantize")
        for p in locks.missing(Path(f"scripts/envs/{lock}-cuda.lock"), Path("bench/gpu/h200-freeze.txt"))}
for w in Path(sys.argv[1]).glob("*.whl"):
    name, version = w.name.split("-")[:2]
    if (locks.norm(name), version) not in want:
        print(f"  dropping {w.name} (no lock pins it now)")
        w.unlink()
PY
    pack "$out/wheels" "$out"
    ;;
  pack) pack "$2" "$3" ;;
  unpack) unpack "$2" ;;
  setup)
    unpack "$2"
    QUANTPIPE_WHEELHOUSE=$2 make setup
    ;;
  *) sed -n '2,17p' "$0" >&2; exit 2 ;;
esac
