"""Publishing a package: a copy out of the cache, swapped in atomically (packages/<artifact> is a link)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path


class PublishError(Exception):
    """Publishing would write outside the output directory; the message says what to remove."""


def publish(out_dir: Path, artifact: str, src: Path, key: str) -> Path:
    """Copy a package out of the cache and swap it in atomically: packages/<artifact> is a link."""
    pk = out_dir / "packages"
    store = store_dir(out_dir, artifact, key)
    for d in (pk, pk / ".store"):
        if d.is_symlink():  # planted: publishing through it would write outside the output directory
            raise PublishError(
                f"{d} is a symbolic link; packages are published only inside {out_dir}: remove the link and run again"
            )
    for stale in [*(pk / ".store").glob(f".{artifact}.tmp-*"), *pk.glob(f".{artifact}.link-*")]:
        # half copies and links of runs killed while publishing (this run holds the output lock)
        stale.unlink() if stale.is_symlink() or not stale.is_dir() else shutil.rmtree(stale, ignore_errors=True)
    if not store.exists():
        tmp = pk / ".store" / f".{artifact}.tmp-{os.getpid()}"
        try:
            shutil.copytree(src, tmp, symlinks=False)
            os.rename(tmp, store)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    link = pk / artifact
    tmp_link = pk / f".{artifact}.link-{os.getpid()}"
    if tmp_link.is_symlink():
        tmp_link.unlink()
    os.symlink(os.path.relpath(store, pk), tmp_link)
    if link.exists() and not link.is_symlink():
        shutil.rmtree(link)
    os.replace(tmp_link, link)
    for old in (pk / ".store").glob(f"{artifact}-*"):
        if old != store:
            shutil.rmtree(old, ignore_errors=True)
    return link


def store_dir(out_dir: Path, artifact: str, key: str) -> Path:
    """Where the package of `artifact` built as entry `key` is published: packages/.store/<artifact>-<key[:16]>."""
    return Path(out_dir) / "packages" / ".store" / f"{artifact}-{key[:16]}"


def unpublished(steps, out_dir: Path) -> set[str]:
    """The package stages whose published copy is missing from `out_dir`: the run copies it there, from a cache hit too."""
    return {s.id for s in steps if s.kind == "package" and not store_dir(out_dir, s.artifact, s.key).is_dir()}


def published(out_dir: Path) -> dict[str, dict]:
    """Each live package of `out_dir` (a packages/<artifact> link): its manifest's stage keys, {stage id: key}."""
    from ..stages.package.verify import MANIFEST

    found = {}
    pk = Path(out_dir) / "packages"
    for link in sorted(pk.glob("[!.]*")) if pk.is_dir() else []:
        try:
            keys = json.loads((link / MANIFEST).read_text()).get("stage_keys")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(keys, dict):
            found[link.name] = {str(k): str(v) for k, v in keys.items()}
    return found
