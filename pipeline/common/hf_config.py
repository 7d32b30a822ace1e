"""Reading a Hugging Face model directory's config.json without transformers."""

from __future__ import annotations

import json
from pathlib import Path


def read_config(model_dir: str | Path) -> dict | None:
    """config.json as a dict, or None when it is missing or not a JSON object."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def text_part(cfg: dict) -> dict:
    """The language model's part of a config: its `text_config` for multimodal models, else the config itself."""
    return cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg


def text_config(model_dir: str | Path) -> dict:
    """The language model's config of a model directory ({} when unreadable)."""
    cfg = read_config(model_dir)
    return text_part(cfg) if cfg is not None else {}
