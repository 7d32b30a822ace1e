#!/usr/bin/env bash
# Fill a wheel folder for a host without a package index, on a machine that has one; then, there:
#   QUANTPIPE_WHEELHOUSE=DIR make setup        (pip --no-index --find-links DIR)
#
#   scripts/wheelhouse.sh DIR                              the wheels of the CUDA locks (quantize and serve)
#   scripts/wheelhouse.sh DIR serve                        one environment's
#   scripts/wheelhouse.sh --have FREEZE DIR                only what the target host lacks: FREEZE is its
#                                                          `python3 -m pip list --format=freeze`
#   scripts/wheelhouse.sh --platform cpu DIR               the CPU locks' wheels instead
#
# Wheels are for the target, not for this machine: the CPython of the lock's `# python:` line (3.12 for
# the CUDA locks; PYTHON_VERSION overrides it) on Linux x86_64, glibc >= 2.17 (manylinux). A pin with no
# wheel on the index (a pure-Python sdist such as rouge_score; the lock's `# no-wheel:` line names those
# it knows) is built into a py3-none-any wheel here. Re-running it fetches only what DIR lacks. With
# --have and a host whose torch is the lock's, no torch is fetched: set-up reuses the host's.
set -euo pipefail
cd "$(dirname "$0")/.."
platform=cuda have="" dir=""
envs=()
while [ $# -gt 0 ]; do
  case $1 in
    --have) have=$(cd "$(dirname "$2")" && pwd)/$(basename "$2"); shift 2 ;;
    --platform) platform=$2; shift 2 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | grep '^#'; exit 0 ;;
    -*) echo "wheelhouse.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) if [ -z "$dir" ]; then dir=$1; else envs+=("$1"); fi; shift ;;
  esac
done
[ -n "$dir" ] || { echo "usage: scripts/wheelhouse.sh [--have FREEZE] [--platform cpu|cuda] DIR [ENV...]" >&2; exit 2; }
[ -z "$have" ] || [ -f "$have" ] || { echo "wheelhouse.sh: --have $have: no such file (make it on the host: python3 -m pip list --format=freeze > FILE)" >&2; exit 2; }
case $platform in cpu) suffix="" ;; cuda) suffix=-cuda ;; *) echo "wheelhouse.sh: --platform is cpu or cuda" >&2; exit 2 ;; esac
[ ${#envs[@]} -gt 0 ] || envs=(quantize serve)
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
PY=${PYTHON:-python3}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pyver=""
for env in "${envs[@]}"; do
  lock=scripts/envs/$env$suffix.lock
  [ -f "$lock" ] || { echo "wheelhouse.sh: no lock $lock" >&2; exit 2; }
  v=$("$PY" scripts/locks.py meta "$lock" python)
  [ -z "$pyver" ] || [ -z "$v" ] || [ "$v" = "$pyver" ] || { echo "wheelhouse.sh: the locks name different Pythons ($pyver, $v)" >&2; exit 2; }
  pyver=${v:-$pyver}
done
pyver=${PYTHON_VERSION:-${pyver:-$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')}}
abi=cp${pyver/./}
plats=(--platform any --platform linux_x86_64 --platform manylinux1_x86_64 --platform manylinux2010_x86_64 --platform manylinux2014_x86_64)
for n in $(seq 17 39); do plats+=(--platform "manylinux_2_${n}_x86_64"); done
target=(--only-binary=:all: --python-version "$pyver" --implementation cp --abi "$abi" --abi abi3 --abi none "${plats[@]}")

fetch() {  # fetch WANT LOCK: one pip download per lock (two locks may pin one package at two versions)
  local want=$1 lock=$2 fails=$tmp/fails.txt miss w name
  : > "$fails"
  for name in $("$PY" scripts/locks.py meta "$lock" no-wheel | tr ',' ' '); do  # known to have no wheel: build them
    grep -iE "^${name//[-_.]/[-_.]}==" "$want" >> "$fails" || true
  done
  # A pin pip finds no wheel for is set aside (built below) and the rest retried; what DIR holds is not fetched again.
  for _ in $(seq 20); do
    grep -vxF -f "$fails" "$want" > "$tmp/now.txt" || true
    [ -s "$tmp/now.txt" ] || break
    if "$PY" -m pip download -q --no-deps "${target[@]}" --find-links "$dir" -d "$dir" -r "$tmp/now.txt" > "$tmp/log" 2>&1; then break; fi
    miss=$(sed -n 's/.*No matching distribution found for \([^ ]*\).*/\1/p' "$tmp/log" | head -1)
    [ -n "$miss" ] && grep -qxF "$miss" "$tmp/now.txt" || { grep -v "WARNING: Location" "$tmp/log" >&2; echo "wheelhouse.sh: pip download failed (above)" >&2; exit 1; }
    echo "$miss" >> "$fails"
  done
  while read -r req; do  # no wheel for the target: build one here, accepted only if it is pure Python
    rm -rf "$tmp/built"
    "$PY" -m pip wheel -q --no-deps -w "$tmp/built" "$req" >/dev/null 2>"$tmp/err" || { cat "$tmp/err" >&2; echo "wheelhouse.sh: $req has no wheel for CPython $pyver linux x86_64 and does not build here" >&2; exit 1; }
    for w in "$tmp"/built/*.whl; do
      case $w in *-py3-none-any.whl | *-py2.py3-none-any.whl) mv "$w" "$dir/" ;; *) echo "wheelhouse.sh: $req built into $(basename "$w"), which is not pure Python: build it on the target" >&2; exit 1 ;; esac
    done
    echo "    built $req (no wheel on the index)"
  done < "$fails"
}

for env in "${envs[@]}"; do
  lock=scripts/envs/$env$suffix.lock
  "$PY" scripts/locks.py missing "$lock" --have "${have:-/dev/null}" > "$tmp/want.txt"
  echo "==> $env: $(grep -c . "$tmp/want.txt" || true) pins of $lock${have:+ that $(basename "$have") lacks}, for CPython $pyver linux x86_64"
  [ ! -s "$tmp/want.txt" ] || fetch "$tmp/want.txt" "$lock"
done
echo "==> $(find "$dir" -maxdepth 1 -name '*.whl' | wc -l) wheels, $(du -sh "$dir" | cut -f1) in $dir"
