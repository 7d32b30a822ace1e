"""Keeping the stage cache to what is needed: the entries of each output directory's last N runs, of its published
packages and of every run still running stay; the rest goes. The cache's runs.jsonl says which entries each run
used (every run writes its keys there before its first stage, and its status at its end). An entry goes by one rename
under its lock, so an entry a run is building (holding the lock) is skipped, and no run registers while prune
decides. Bytes are counted once per file (inode): a package entry's shards are hard links to its quantize entry's.

    survey(Path("~/.cache/quantpipe"), keep_runs=3)     # what the cache holds and which entries are needed
    prune(Path("~/.cache/quantpipe"), keep_runs=3)      # remove the rest; dry_run=True only says what would go
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..cache import RUNS_LOG, StageCache, alive, freed_bytes, inodes
from .publish import published
from .record import RunRecord

DEFAULT_KEEP_RUNS = 3


class PruneError(Exception):
    """The cache or the arguments cannot be pruned as given; the message says why and what to give instead."""


@dataclass
class Entry:
    stage: str
    key: str
    bytes: int  # its files, each counted once in the whole cache: a file shared with an older entry counts there
    needed_by: list[str] = field(default_factory=list)  # "run <output_dir> <run_id>", "package ...", "running run ..."

    @property
    def kind(self) -> str:
        return self.stage.split(":")[0]


@dataclass
class Survey:
    """What a stage cache holds and which of its entries recorded runs, live packages and running runs need."""

    root: Path
    keep_runs: int
    entries: list[Entry]
    runs: int  # runs recorded in runs.jsonl
    output_dirs: list[str]  # that used the cache and still exist
    gone: list[str]  # output directories whose runs/ no longer exists: their runs keep nothing
    running: list[str]  # "<output_dir> <run_id>" of runs alive now
    packages: int  # live packages whose entries are kept

    @property
    def unneeded(self) -> list[Entry]:
        return [e for e in self.entries if not e.needed_by]

    def reclaimable_bytes(self) -> int:
        """What removing the unneeded entries would free: their files with no link in a kept entry."""
        cache = StageCache(self.root)
        return freed_bytes(inodes([cache.entry(e.stage, e.key) for e in self.unneeded]))


@dataclass
class Pruned:
    survey: Survey
    removed: list[Entry]
    locked: list[Entry]  # unneeded, but another process held its lock: left in place
    freed_bytes: int
    dry_run: bool


def check_cache(root: Path) -> None:
    """PruneError unless `root` is a directory (a stage cache, possibly empty)."""
    if not root.exists():
        raise PruneError(
            f"{root}: no such directory, so no stage cache there; give the cache your runs use "
            "(--cache DIR, $QUANTPIPE_CACHE or the recipe's cache_dir; default ~/.cache/quantpipe)"
        )
    if not root.is_dir():
        raise PruneError(f"{root}: not a directory; give the stage cache's directory (--cache DIR)")


def survey(root: Path, keep_runs: int = DEFAULT_KEEP_RUNS) -> Survey:
    """Every entry of the cache at `root`, its bytes, and why it is needed (nothing: prune removes it)."""
    check_cache(root)
    if keep_runs < 1:
        raise PruneError(
            f"--keep-runs {keep_runs}: keep at least 1 run per output directory (default {DEFAULT_KEEP_RUNS})"
        )
    cache = StageCache(root)
    runs = cache.runs()
    needs: dict[tuple[str, str], list[str]] = {}

    def need(keys, why: str) -> None:
        for stage, key in keys.items() if isinstance(keys, dict) else ():
            needs.setdefault((stage, key), []).append(why)

    by_dir: dict[str, list[dict]] = {}
    for r in runs:
        by_dir.setdefault(r["output_dir"], []).append(r)
    gone, packages = [], 0
    for out_dir, of_dir in by_dir.items():
        if not (Path(out_dir) / "runs").is_dir():
            gone.append(out_dir)
            continue
        for r in with_records(Path(out_dir), root, of_dir)[-keep_runs:]:
            need(r.get("keys"), f"run {out_dir} {r['run_id']}")
        for artifact, keys in published(Path(out_dir)).items():
            need(keys, f"package {Path(out_dir) / 'packages' / artifact}")
            packages += 1
    running = [r for r in runs if r.get("status") == "running" and isinstance(r.get("pid"), int) and alive(r["pid"])]
    for r in running:
        need(r.get("keys"), f"running run {r['output_dir']} {r['run_id']} (pid {r['pid']})")
    entries, seen = [], set()
    for stage, key in cache.entries():  # oldest first: a package's shards count in the quantize entry they link to
        files = inodes([cache.entry(stage, key)])
        entries.append(
            Entry(stage, key, sum(v[0] for k, v in files.items() if k not in seen), needs.get((stage, key), []))
        )
        seen |= set(files)
    return Survey(
        root=root,
        keep_runs=keep_runs,
        entries=entries,
        runs=len(runs),
        output_dirs=[d for d in by_dir if d not in gone],
        gone=gone,
        running=[f"{r['output_dir']} {r['run_id']}" for r in running],
        packages=packages,
    )


def with_records(out_dir: Path, root: Path, logged: list[dict]) -> list[dict]:
    """The runs of `out_dir` on this cache, by start: those runs.jsonl lists, and those whose lines it lacks but whose
    run.json names this cache (`cache_dir`; the keys: its stages')."""
    runs = {r["run_id"]: r for r in logged}
    for path in (out_dir / "runs").glob("*/run.json"):
        if path.parent.name in runs:
            continue
        try:
            rec = RunRecord.read(path)
        except (OSError, ValueError):
            continue
        if rec.cache_dir and Path(rec.cache_dir).resolve() == root.resolve():
            keys = {sid: st.key for sid, st in rec.stages.items() if st.key}
            runs[path.parent.name] = {"run_id": path.parent.name, "status": rec.status, "keys": keys}
    return [runs[k] for k in sorted(runs)]  # run ids start with the UTC start time


def prune(root: Path, keep_runs: int = DEFAULT_KEEP_RUNS, dry_run: bool = False) -> Pruned:
    """Remove the entries no kept run, live package or running run needs; entries whose lock is held are skipped."""
    cache = StageCache(root)
    s = survey(root, keep_runs)
    if s.runs == 0 and s.entries:
        raise PruneError(
            f"{root}: no run has recorded which entries it uses (no {root / RUNS_LOG}), so prune cannot tell what "
            "is needed; run your recipes once (their cached stages are reused) and prune again"
        )
    if dry_run:
        return Pruned(s, s.unneeded, [], s.reclaimable_bytes(), True)
    cache.sweep()
    taken, locked = [], []
    with cache.runs_locked():  # no run registers its keys while prune decides and renames
        s = survey(root, keep_runs)
        for e in s.unneeded:
            trash = cache.take_out(e.stage, e.key)
            if trash is None:
                locked.append(e)
            else:
                taken.append((e, trash))
    freed = freed_bytes(inodes([t for _, t in taken]))
    for _, trash in taken:
        shutil.rmtree(trash, ignore_errors=True)
    return Pruned(s, [e for e, _ in taken], locked, freed, False)
