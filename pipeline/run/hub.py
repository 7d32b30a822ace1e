"""The base model's local directory (a hub id is fetched where a network allows) and the stage cache's root."""

from __future__ import annotations

from pathlib import Path

from ..cache import default_root
from ..recipe import Recipe


class HubError(Exception):
    """The base model cannot be fetched; the message says what to do instead."""


def cache_root(recipe: Recipe) -> Path:
    if recipe.cache_dir:
        return Path(recipe.cache_dir)
    return default_root()


def resolve_base(recipe: Recipe, dry_run: bool) -> str:
    """The local directory of the base model, downloading a hub id where a network allows."""
    if recipe.base.is_local:
        return recipe.base.model
    if dry_run:
        return recipe.base.model
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "tokenizer*"]
        if recipe.base.allow_pickle:
            patterns.append("*.bin")
        return snapshot_download(recipe.base.model, revision=recipe.base.revision, allow_patterns=patterns)
    except Exception as e:  # offline, unknown repo, gated repo...
        raise HubError(
            f"base.model: cannot fetch {recipe.base.model!r} from the hub ({type(e).__name__}: {str(e)[:200]}). "
            "Without a network, download it on a machine that has one and set base.model to the local directory."
        ) from None
