"""`quantpipe cache` and `quantpipe cache prune`: what the stage cache holds, and removing what no kept run, live
package or running run needs, safely beside a running build (fast: entries made with the StageCache API), plus a
real run's registration and a pruned cache's re-run (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from quantpipe.cache import RUNS_LOG, StageCache
from quantpipe.cli import main
from quantpipe.run.prune import prune, survey

SHARD = b"w" * 100_000


def commit(cache: StageCache, stage: str, key: str, files: dict, links: dict | None = None) -> Path:
    """A committed entry of `files` ({name: bytes}) and hard links ({name: file of another entry's out/})."""
    work = cache.begin(stage, key)
    for name, data in files.items():
        (work / "out" / name).write_bytes(data)
    for name, target in (links or {}).items():
        os.link(target, work / "out" / name)
    cache.commit(work, stage, key, {"metrics": {}})
    return cache.entry(stage, key)


def quantized_and_packaged(cache: StageCache, q: str, p: str) -> None:
    """A quantize entry and its package entry, whose shard is a hard link to the quantize entry's (as the stage does)."""
    shard = commit(cache, "quantize:awq", q, {"model.safetensors": SHARD, "config.json": b"{}"}) / "out"
    commit(cache, "package:awq", p, {"README.md": b"card"}, {"model.safetensors": shard / "model.safetensors"})


def finished_run(cache: StageCache, out_dir: Path, run_id: str, keys: dict, status: str = "ok") -> None:
    (out_dir / "runs" / run_id).mkdir(parents=True, exist_ok=True)
    who = {"output_dir": str(out_dir), "run_id": run_id}
    cache.log_run({**who, "status": "running", "pid": os.getpid(), "keys": keys})
    cache.log_run({**who, "status": status, "finished_at": "2026-12-07T00:00:00Z"})


def two_nights(tmp_path) -> tuple[StageCache, Path]:
    """Two runs of one output directory: each its own quantize and package entries, the merge shared."""
    cache, out = StageCache(tmp_path / "cache"), tmp_path / "out"
    commit(cache, "merge", "m1", {"model.safetensors": b"m" * 1000})
    quantized_and_packaged(cache, "q1", "p1")
    quantized_and_packaged(cache, "q2", "p2")
    finished_run(cache, out, "night1", {"merge": "m1", "quantize:awq": "q1", "package:awq": "p1"})
    finished_run(cache, out, "night2", {"merge": "m1", "quantize:awq": "q2", "package:awq": "p2"})
    return cache, out


def tree_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def listing(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


def publish_package(out: Path, artifact: str, keys: dict) -> None:
    store = out / "packages" / ".store" / f"{artifact}-x"
    store.mkdir(parents=True)
    (store / "manifest.json").write_text(json.dumps({"stage_keys": keys}))
    (out / "packages" / artifact).symlink_to(Path(".store") / f"{artifact}-x")


def test_prune_keeps_the_last_runs_entries_and_frees_the_rest_counting_each_inode_once(tmp_path):
    cache, out = two_nights(tmp_path)
    old = [cache.entry("quantize:awq", "q1"), cache.entry("package:awq", "p1")]
    naive = sum(tree_bytes(d) for d in old)  # the shard counted in both entries
    p = prune(cache.root, keep_runs=1)
    assert {(e.stage, e.key) for e in p.removed} == {("quantize:awq", "q1"), ("package:awq", "p1")}
    assert p.freed_bytes == naive - len(SHARD) and p.locked == []
    assert not any(d.exists() for d in old)
    assert set(cache.entries()) == {("merge", "m1"), ("quantize:awq", "q2"), ("package:awq", "p2")}
    assert not list((cache.root / "stages").glob("**/.*.bad-*"))  # the renamed entries were deleted, not left
    assert prune(cache.root, keep_runs=1).removed == []  # what the kept run needs stays


def test_a_live_package_keeps_its_entries_and_their_shared_bytes_are_not_counted_as_freed(tmp_path):
    """night1's package is still published: its entries stay. With only its package entry kept, removing its quantize
    entry frees no shard bytes, because the package entry still links the shard."""
    cache, out = two_nights(tmp_path)
    publish_package(out, "awq", {"merge": "m1", "quantize:awq": "q1", "package:awq": "p1"})
    p = prune(cache.root, keep_runs=1)
    assert p.removed == [] and p.survey.packages == 1
    (out / "packages" / "awq").unlink()
    publish_package(out, "awq-card", {"package:awq": "p1"})
    expected = tree_bytes(cache.entry("quantize:awq", "q1")) - len(SHARD)
    p = prune(cache.root, keep_runs=1)
    assert [(e.stage, e.key) for e in p.removed] == [("quantize:awq", "q1")]
    assert p.freed_bytes == expected
    assert (cache.entry("package:awq", "p1") / "out" / "model.safetensors").read_bytes() == SHARD


def test_dry_run_says_what_would_go_and_removes_nothing(tmp_path):
    cache, _ = two_nights(tmp_path)
    before = listing(tmp_path)
    res = CliRunner().invoke(main, ["cache", "prune", "--keep-runs", "1", "--dry-run", "--cache", str(cache.root)])
    assert res.exit_code == 0, res.output
    assert "would remove 2 entries (package 1, quantize 1)" in res.output and "nothing was removed" in res.output
    assert listing(tmp_path) == before
    real = prune(cache.root, keep_runs=1)
    assert f"would free {real.freed_bytes / 1024:.1f} KiB" in res.output  # the dry run's figure is what prune frees


def test_an_entry_whose_lock_another_process_holds_is_skipped_and_named(tmp_path):
    cache, _ = two_nights(tmp_path)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
                import sys
                from filelock import FileLock
                with FileLock({str(cache.entry("quantize:awq", "q1")) + ".lock"!r}):
                    print("held", flush=True)
                    sys.stdin.read()
            """),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        res = CliRunner().invoke(main, ["cache", "prune", "--keep-runs", "1", "--cache", str(cache.root)])
    finally:
        holder.communicate("", timeout=30)
    assert res.exit_code == 0, res.output
    assert "skipped quantize:awq q1: another process holds its lock" in res.output
    assert cache.lookup("quantize:awq", "q1") is not None  # left whole, and the rest went
    assert cache.lookup("package:awq", "p1") is None and "removed 1 entry (package 1)" in res.output


def test_the_entries_of_a_running_run_are_kept_and_a_dead_ones_are_not(tmp_path):
    """A running run's registration (its pid alive) keeps its entries even where no kept run lists them; a registration
    whose process died (a killed run) keeps nothing."""
    cache, out = two_nights(tmp_path)
    commit(cache, "quantize:int8", "live", {"model.safetensors": b"l"})
    commit(cache, "quantize:int8", "dead", {"model.safetensors": b"d"})
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    elsewhere = str(tmp_path / "elsewhere")  # its runs/ is not there: no kept run of it
    cache.log_run(
        {
            "output_dir": elsewhere,
            "run_id": "r1",
            "status": "running",
            "pid": os.getpid(),
            "keys": {"quantize:int8": "live"},
        }
    )
    cache.log_run(
        {
            "output_dir": elsewhere,
            "run_id": "r2",
            "status": "running",
            "pid": int(dead.stdout),
            "keys": {"quantize:int8": "dead"},
        }
    )
    p = prune(cache.root, keep_runs=1)
    assert cache.lookup("quantize:int8", "live") is not None and cache.lookup("quantize:int8", "dead") is None
    assert ("quantize:int8", "dead") in {(e.stage, e.key) for e in p.removed}
    assert p.survey.running == [f"{elsewhere} r1"]


def test_the_cache_command_shows_entries_bytes_and_what_is_needed_per_kind(tmp_path):
    cache, out = two_nights(tmp_path)
    res = CliRunner().invoke(main, ["cache", "--cache", str(cache.root)])
    assert res.exit_code == 0, res.output
    rows = {ln.split()[0]: ln.split() for ln in res.output.splitlines()[2:6]}
    assert rows["quantize"][1] == "2" and rows["package"][1] == "2" and rows["merge"][1] == "1"
    assert rows["quantize"][-1] == "2" and rows["total"][1] == "5" and rows["total"][-1] == "5"  # 3 runs by default
    s = survey(cache.root)
    assert sum(e.bytes for e in s.entries) < sum(tree_bytes(cache.entry(e.stage, e.key)) for e in s.entries)
    assert "would remove 0 entries" in res.output
    res = CliRunner().invoke(main, ["cache", "--cache", str(cache.root), "--entries"])
    line = next(ln for ln in res.output.splitlines() if ln.split()[:2] == ["quantize:awq", "q1"])
    assert line.endswith(f"run {out} night1")  # night2 built its own quantize entry


@pytest.mark.parametrize(
    "args, needle",
    [
        (["cache", "prune", "--cache", "{missing}"], "no such directory"),
        (["cache", "--cache", "{missing}"], "no such directory"),
        (["cache", "prune", "--keep-runs", "0", "--cache", "{cache}"], "--keep-runs"),
        (["cache", "prune", "--cache", "{unlogged}"], "no run has recorded which entries it uses"),
    ],
)
def test_bad_input_exits_2_with_a_sentence_and_writes_nothing(tmp_path, args, needle):
    cache, _ = two_nights(tmp_path)
    unlogged = StageCache(tmp_path / "unlogged")
    commit(unlogged, "merge", "m", {"a": b"a"})
    before = listing(tmp_path)
    where = {"missing": tmp_path / "missing", "cache": cache.root, "unlogged": unlogged.root}
    res = CliRunner().invoke(main, [a.format(**where) for a in args])
    assert res.exit_code == 2, res.output
    assert needle in res.output and "Traceback" not in res.output
    assert listing(tmp_path) == before


def test_a_run_json_naming_this_cache_counts_as_a_run_where_runs_log_lacks_it(tmp_path):
    """night3 has only its run.json (cache_dir this cache): it is the last run and keeps its entries; night4's names
    another cache and keeps nothing here."""
    from quantpipe.run.record import RunRecord, write_record

    cache, out = two_nights(tmp_path)
    commit(cache, "quantize:awq", "q3", {"model.safetensors": b"3"})
    for run_id, where in (("night3", cache.root), ("night4", tmp_path / "other-cache")):
        (out / "runs" / run_id).mkdir()
        keys = {"merge": "m1", "quantize:awq": "q3"} if run_id == "night3" else {"quantize:awq": "q1"}
        stages = {sid: {"key": key, "status": "ok"} for sid, key in keys.items()}
        rec = RunRecord.of({"run_id": run_id, "cache_dir": str(where), "status": "ok", "stages": stages})
        write_record(out / "runs" / run_id, rec, [])
    p = prune(cache.root, keep_runs=1)
    assert set(cache.entries()) == {("merge", "m1"), ("quantize:awq", "q3")}
    assert len(p.removed) == 4


def test_runs_log_survives_a_torn_line_and_merges_each_runs_start_and_end(tmp_path):
    cache, out = two_nights(tmp_path)
    with open(cache.root / RUNS_LOG, "a") as f:
        f.write('{"output_dir": "x", "run_')  # a write cut short by a full disk
    runs = cache.runs()
    assert [r["run_id"] for r in runs] == ["night1", "night2"]
    assert runs[0]["status"] == "ok" and runs[0]["keys"]["quantize:awq"] == "q1"


# --- a real run (slow) --------------------------------------------------------------------------------------------


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "quantpipe", *args], capture_output=True, text=True, timeout=900)


def tiny_recipe(tiny, tmp_path: Path, name: str, method: str) -> Path:
    d = {
        "name": "prune",
        "output_dir": str(tmp_path / "out"),
        "cache_dir": str(tmp_path / "cache"),
        "base": {"model": str(tiny.llama)},
        "artifacts": [{"name": "q", "method": method}],
        "benchmark": {"enabled": False},
        "package": {"enabled": False},
    }
    p = tmp_path / name
    p.write_text(yaml.safe_dump(d))
    return p


@pytest.mark.slow
def test_a_real_run_registers_its_keys_and_prune_keeps_what_its_rerun_hits(tiny, tmp_path):
    """Two runs that differ in the quantize stage; prune --keep-runs 1 removes the first run's quantize entry only,
    and a dry run of the second recipe is all cache hits."""

    first, second = tiny_recipe(tiny, tmp_path, "a.yaml", "fp8"), tiny_recipe(tiny, tmp_path, "b.yaml", "rtn")
    for r in (first, second):
        done = run_cli("run", str(r))
        assert done.returncode == 0, done.stderr
    cache = StageCache(tmp_path / "cache")
    runs = cache.runs()
    recorded = [json.loads(p.read_text()) for p in sorted((tmp_path / "out" / "runs").glob("*/run.json"))]
    assert [r["run_id"] for r in runs] == [r["run_id"] for r in recorded]
    assert runs[0]["keys"] == {sid: st["key"] for sid, st in recorded[0]["stages"].items()}
    assert runs[0]["status"] == "ok" and runs[0]["pid"] > 0
    lines = [json.loads(ln) for ln in (cache.root / RUNS_LOG).read_text().splitlines()]
    assert [ln["status"] for ln in lines] == ["running", "ok", "running", "ok"] and "keys" in lines[0]  # keys first

    pruned = run_cli("cache", "prune", "--keep-runs", "1", "--cache", str(cache.root))
    assert pruned.returncode == 0, pruned.stderr
    assert "removed 1 entry (quantize 1)" in pruned.stdout
    assert cache.lookup("quantize:q", runs[0]["keys"]["quantize:q"]) is None
    assert cache.lookup("quantize:q", runs[1]["keys"]["quantize:q"]) is not None

    dry = run_cli("run", "--dry-run", str(second))
    assert dry.returncode == 0, dry.stderr
    plan = [
        ln.split("│")
        for ln in (dry.stdout + dry.stderr).splitlines()
        if ln.strip("│ ").startswith(("merge ", "quantize:q "))
    ]
    assert [[c.strip() for c in row][4] for row in plan] == ["hit", "hit"], dry.stderr


@pytest.mark.slow
def test_prune_beside_a_running_build_leaves_it_whole(tiny, tmp_path):
    """Prune while a run's quantize worker is mid-build (held stopped): the run's registration keeps the merge entry
    it reads, its working folder stays, an older run's entry goes, and the run then finishes with whole entries."""
    import psutil

    cache = StageCache(tmp_path / "cache")
    commit(cache, "quantize:q", "stale", {"model.safetensors": SHARD})
    finished_run(cache, tmp_path / "out", "20260101-000000-1", {"quantize:q": "stale"})
    run = subprocess.Popen(
        [sys.executable, "-m", "quantpipe", "run", str(tiny_recipe(tiny, tmp_path, "r.yaml", "fp8"))],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    building = str(cache.root / "stages" / "quantize" / "q" / ".")

    def worker():
        for p in psutil.Process(run.pid).children(recursive=True):
            try:
                if any(building in arg for arg in p.cmdline()):
                    return p
            except psutil.Error:
                continue
        return None

    try:
        deadline = time.monotonic() + 600
        while (w := worker()) is None:
            assert run.poll() is None and time.monotonic() < deadline, run.stderr.read()[-3000:]
            time.sleep(0.02)
        w.suspend()
        pruned = run_cli("cache", "prune", "--keep-runs", "1", "--cache", str(cache.root))
        work = list((cache.root / "stages" / "quantize" / "q").glob(".*.tmp-*"))
        w.resume()
    finally:
        err = run.communicate(timeout=600)[1]
    assert pruned.returncode == 0, pruned.stderr
    assert "removed 1 entry (quantize 1)" in pruned.stdout and "1 running run" in pruned.stdout
    assert work, "prune swept the running build's working folder"
    assert run.returncode == 0, err[-3000:]
    keys = cache.runs()[-1]["keys"]
    assert cache.lookup("quantize:q", "stale") is None
    for stage in ("merge", "quantize:q"):
        assert cache.verify_entry(stage, keys[stage], cache.lookup(stage, keys[stage])) == []
