"""Asking nvidia-smi, and which GPUs CUDA_VISIBLE_DEVICES leaves visible."""

from __future__ import annotations

import os
import shutil
import subprocess


def nvidia_smi(*args: str, timeout: float = 20) -> list[list[str]]:
    """nvidia-smi's non-blank stdout lines, each split on "," and stripped; [] where it is missing, fails or times out."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        r = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return []
    return [[x.strip() for x in line.split(",")] for line in r.stdout.splitlines() if line.strip()]


def visible_gpus() -> list[str] | None:
    """The GPUs CUDA_VISIBLE_DEVICES names (stripped, non-empty, not starting with "-"); None where it is unset (all
    visible), [] where it hides every GPU ("" or "-1")."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    return [v.strip() for v in visible.split(",") if v.strip() and not v.strip().startswith("-")]
