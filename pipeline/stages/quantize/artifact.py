"""What every quantize backend writes besides the weights: side files, metrics, seeds."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

from ...common.methods import scheme_name
from ...common.safetensors import weights_bytes

# Copied verbatim from the merged model: what a user of the artifact needs besides the weights.
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
SHARD_SIZE = "5GB"  # safetensors shard size of a quantized checkpoint (the merge stage writes the same)


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def output_metrics(a, src: Path, out: Path, provenance: dict) -> dict:
    """What every backend records about an artifact: scheme, sizes against the baseline, calibration used."""
    size, base_size = dir_bytes(out), dir_bytes(src)
    w, base_w = weights_bytes(out), weights_bytes(src)
    return {
        "method": a.method,
        "scheme": scheme_name(a),
        "group_size": getattr(a, "group_size", None),
        "size_bytes": size,
        "baseline_size_bytes": base_size,
        "compression": round(base_size / size, 4) if size else None,
        "weights_bytes": w,
        "baseline_weights_bytes": base_w,
        "weights_compression": round(base_w / w, 4) if w else None,
        "calibration_sha256": provenance["calibration_sha256"],
        "n_calibration_samples": provenance["n_samples"],
        "n_calibration_tokens": provenance["n_tokens"],
        "truncated_samples": provenance["truncated_samples"],
    }


def copy_side_files(src: Path, out: Path) -> list[str]:
    copied = []
    for name in SIDE_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
            copied.append(name)
    return copied
