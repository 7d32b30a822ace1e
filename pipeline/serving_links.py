"""The stable serving link: a model directory served under a path that stays the same from one build to the next.

vLLM keys its torch.compile cache on the model's path (`ModelConfig.compute_hash` keeps `model`), so an artifact rebuilt
into a new stage-cache directory would compile again: ~30 s of a ~85 s server start for an 8B model on an H200. The
benchmark stage serves each artifact through a link named by what the compiled graphs depend on (config.json and any
legacy quantization config file), so a rebuild of the same shape and scheme finds the graphs compiled for the last one.
The links live next to vLLM's compile cache (`$QUANTPIPE_SERVING_LINKS` overrides where).

    with stable_path(artifact_dir) as served:    # ~/.cache/vllm/quantpipe-paths/3f2a9c01d4e5b6a7
        Server(served, ...)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path


def serving_links_dir() -> Path:
    """Where `stable_path` keeps its links: next to vLLM's compile cache, which they serve."""
    root = (
        os.environ.get("VLLM_CACHE_ROOT") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vllm"
    )
    return Path(os.environ.get("QUANTPIPE_SERVING_LINKS") or Path(root) / "quantpipe-paths")


QUANT_CONFIG_FILES = ("quantize_config.json", "quant_config.json", "hf_quant_config.json")


@contextlib.contextmanager
def stable_path(model: str | Path) -> Iterator[Path]:
    """The model directory under a path that stays the same from one build to the next, held under an exclusive lock; the
    model's own path where another server holds the link or none can be made (a compile, nothing worse)."""
    given, model = model, Path(model).resolve()
    try:
        cfg = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):  # not a local model directory (a hub id): nothing to link
        yield given
        return
    cfg.pop("_name_or_path", None)
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode())
    for extra in QUANT_CONFIG_FILES:  # where vLLM also looks for a quantization config
        if (model / extra).is_file():
            h.update(extra.encode() + b"\0" + (model / extra).read_bytes())
    name = h.hexdigest()[:16]
    links = serving_links_dir()
    try:
        links.mkdir(parents=True, exist_ok=True)
        lock = os.fdopen(os.open(links / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644), "r+")
    except OSError:
        yield model
        return
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another server of the same shape and scheme is using the link
            yield model
            return
        link, tmp = links / name, links / f"{name}.{os.getpid()}.tmp"
        try:
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(model, target_is_directory=True)
            os.replace(tmp, link)
        except OSError:
            tmp.unlink(missing_ok=True)
            yield model
            return
        yield link
