"""The stage cache: atomic commits, corruption detection, memoized hashing (fast, no models)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from quantpipe.cache import MARKER, ContentHasher, StageCache, hash_json


def build(cache, stage="quantize:a", key="k1", files=None):
    work = cache.begin(stage, key)
    for name, data in (files or {"model.safetensors": b"weights", "sub/config.json": b"{}"}).items():
        p = work / "out" / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return work


def test_commit_is_visible_only_when_complete(tmp_path):
    cache = StageCache(tmp_path)
    work = build(cache)
    assert cache.lookup("quantize:a", "k1") is None  # building: not visible
    marker = cache.commit(work, "quantize:a", "k1", {"metrics": {"x": 1}})
    assert not work.exists()
    got = cache.lookup("quantize:a", "k1")
    assert got["metrics"] == {"x": 1} and set(got["files"]) == {"model.safetensors", "sub/config.json"}
    assert got == json.loads((cache.entry("quantize:a", "k1") / MARKER).read_text()) == json.loads(json.dumps(marker))
    assert cache.verify_entry("quantize:a", "k1", got) == []


@pytest.mark.parametrize(
    "damage,needle",
    [
        (lambda p: p.write_bytes(b"weightz"), "sha256 mismatch"),
        (lambda p: p.write_bytes(b"wei"), "size"),
        (lambda p: p.unlink(), "missing"),
        (lambda p: (p.parent / "extra.bin").write_bytes(b"x"), "not written by the stage"),
    ],
)
def test_corruption_is_detected(tmp_path, damage, needle):
    cache = StageCache(tmp_path)
    cache.commit(build(cache), "quantize:a", "k1", {})
    damage(cache.entry("quantize:a", "k1") / "out" / "model.safetensors")
    problems = cache.verify_entry("quantize:a", "k1", cache.lookup("quantize:a", "k1"))
    assert any(needle in p for p in problems), problems


def test_unchanged_files_are_not_rehashed_on_use_unless_asked(tmp_path, monkeypatch):
    """On use, a file whose size and mtime are as committed is trusted (a 16 GB model is not re-read per
    run); a rewrite of the same size is caught by its mtime; QUANTPIPE_VERIFY=full re-hashes even a
    tampered file whose mtime was put back."""
    import quantpipe.cache as qc

    cache = StageCache(tmp_path)
    marker = cache.commit(build(cache), "quantize:a", "k1", {})
    real, calls = qc.sha256_file, []
    monkeypatch.setattr(qc, "sha256_file", lambda p, *a: calls.append(p) or real(p, *a))
    assert cache.verify_entry("quantize:a", "k1", marker) == [] and calls == []
    p = cache.entry("quantize:a", "k1") / "out" / "model.safetensors"
    st = p.stat()
    p.write_bytes(b"weightz")
    assert any("sha256 mismatch" in x for x in cache.verify_entry("quantize:a", "k1", marker))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))  # tampered, mtime restored
    assert cache.verify_entry("quantize:a", "k1", marker) == []
    monkeypatch.setenv("QUANTPIPE_VERIFY", "full")
    assert any("sha256 mismatch" in x for x in cache.verify_entry("quantize:a", "k1", marker))


def test_files_linked_from_an_input_entry_take_its_recorded_hash(tmp_path, monkeypatch):
    """The package stage hard-links its quantize entry's shards: committing it reads only its own new files.
    A copy (another inode) or a linked file written since (another mtime) is read and hashed."""
    import quantpipe.cache as qc

    cache = StageCache(tmp_path)
    q = cache.commit(
        build(cache, "quantize:a", "q", {"model.safetensors": b"weights", "copied.json": b"{}"}), "quantize:a", "q", {}
    )
    q_out = cache.entry("quantize:a", "q") / "out"
    work = build(cache, "package:a", "p", {"manifest.json": b"{...}"})
    os.link(q_out / "model.safetensors", work / "out" / "model.safetensors")
    (work / "out" / "copied.json").write_bytes((q_out / "copied.json").read_bytes())
    real, calls = qc.sha256_file, []
    monkeypatch.setattr(qc, "sha256_file", lambda p, *a: calls.append(p.name) or real(p, *a))
    pkg = cache.commit(work, "package:a", "p", {}, inputs=[q_out, tmp_path / "not-an-entry"])
    assert sorted(calls) == ["copied.json", "manifest.json"]
    assert (
        pkg["files"]["model.safetensors"]["sha256"]
        == q["files"]["model.safetensors"]["sha256"]
        == real(q_out / "model.safetensors")
    )
    assert cache.verify_entry("package:a", "p", pkg) == []
    # The linked file rewritten in place after the quantize commit: its mtime moved, so it is read again.
    work = build(cache, "package:a", "p2", {"card.md": b"#"})
    os.link(q_out / "model.safetensors", work / "out" / "model.safetensors")
    (work / "out" / "model.safetensors").write_bytes(b"tampered")
    calls.clear()
    pkg2 = cache.commit(work, "package:a", "p2", {}, inputs=[q_out])
    assert sorted(calls) == ["card.md", "model.safetensors"] and pkg2["files"]["model.safetensors"]["sha256"] == real(
        q_out / "model.safetensors"
    )


def test_a_stage_killed_midway_leaves_no_entry(tmp_path):
    """A process that dies between begin() and commit() leaves only a temp folder, swept later."""
    code = textwrap.dedent(f"""
        import os, sys
        from quantpipe.cache import StageCache
        c = StageCache({str(tmp_path)!r})
        w = c.begin("merge", "kk")
        (w / "out" / "half.safetensors").write_bytes(b"x" * 1000)
        os.kill(os.getpid(), 9)
    """)
    r = subprocess.run([sys.executable, "-c", code])
    assert r.returncode == -9
    cache = StageCache(tmp_path)
    assert cache.lookup("merge", "kk") is None
    leftovers = list((tmp_path / "stages" / "merge").glob(".kk.tmp-*"))
    assert leftovers
    cache.sweep()
    assert not list((tmp_path / "stages" / "merge").glob(".kk.tmp-*"))


def test_recommit_replaces_a_discarded_entry(tmp_path):
    cache = StageCache(tmp_path)
    cache.commit(build(cache, "merge", "k"), "merge", "k", {"metrics": {"v": 1}})
    cache.discard("merge", "k")
    assert cache.lookup("merge", "k") is None
    cache.commit(build(cache, "merge", "k"), "merge", "k", {"metrics": {"v": 2}})
    assert cache.lookup("merge", "k")["metrics"] == {"v": 2}


def test_hasher_memoizes_by_size_and_mtime(tmp_path, monkeypatch):
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"a" * 100)
    h = ContentHasher(tmp_path / "memo.json")
    first = h.file(f)
    h.save()
    calls = []
    import quantpipe.cache as qc

    monkeypatch.setattr(qc, "sha256_file", lambda p, *a: calls.append(p) or "x")
    h2 = ContentHasher(tmp_path / "memo.json")
    assert h2.file(f) == first and calls == []  # memo hit: the file is not read again
    f.write_bytes(b"b" * 100)
    os.utime(f, ns=(1, 1))
    assert h2.file(f) == "x" and len(calls) == 1  # changed mtime: re-hashed


def test_tree_hash_depends_on_names_and_content(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "a").write_text("1")
    (d / "b").write_text("2")
    h = ContentHasher(tmp_path / "memo.json")
    t1 = h.tree(d)
    (d / "b").rename(d / "c")
    assert h.tree(d) != t1
    assert hash_json({"a": 1, "b": 2}) == hash_json({"b": 2, "a": 1})


def test_sweep_removes_what_dead_runs_left_and_nothing_else(tmp_path):
    """Working, replaced (.old) and discarded (.bad) folders of a run that died go; a live run's stay."""
    cache = StageCache(tmp_path)
    cache.commit(build(cache, "merge", "k"), "merge", "k", {})
    dead = subprocess.Popen(["true"])
    dead.wait()
    parent = cache.entry("merge", "k").parent
    left = [parent / f".k.{kind}-{dead.pid}-1" for kind in ("tmp", "old", "bad")]
    live = parent / f".k.tmp-{os.getpid()}-2"
    for d in [*left, live]:
        (d / "out").mkdir(parents=True)
    cache.sweep()
    assert [d for d in left if d.exists()] == [] and live.exists()
    assert cache.lookup("merge", "k") is not None  # committed entries are never touched
