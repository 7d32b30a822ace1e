"""Content-addressed stage cache with atomic commits.

A stage's key hashes its config, the keys of the stages it reads, the content of external inputs (memoized by path,
size and mtime) and its environment lock. An entry is `<root>/stages/<stage>/<key>/` holding `out/` and a marker
`entry.json` written last; it appears under its final name by one `rename`, so a reader sees a whole entry or none.
The marker records each output file's size and sha256, so a truncated, deleted or flipped file is found and rebuilt.
`<root>/runs.jsonl` says which entries each run uses: a line when it starts (its pid and keys), a line when it ends;
`quantpipe cache prune` keeps what recent runs, published packages and running runs need (run/prune.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

MARKER = "entry.json"
RUNS_LOG = "runs.jsonl"
_LEFTOVER = re.compile(r"\.(?:tmp|old|bad)-(\d+)-\d+$")  # .<key>.tmp-<pid>-<ns>: begin(), commit(), discard()


def sha256_file(path: Path, bufsize: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def recorded_hashes(outs) -> dict:
    """The sha256 that entries `outs` (`<entry>/out`; others skipped) recorded, by (dev, inode, size, mtime_ns).
    Spares re-hashing shards hard-linked from another entry: committed files are never rewritten (a write changes mtime)."""
    known = {}
    for out in outs:
        out = Path(out)
        try:
            files = json.loads((out.parent / MARKER).read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        for rel, rec in files.items():
            try:
                st = (out / rel).stat()
            except OSError:
                continue
            known[(st.st_dev, st.st_ino, rec["size"], rec.get("mtime_ns"))] = rec["sha256"]
    return known


def file_sha256(path: Path, known: dict) -> str:
    """sha256 of a file: the one `recorded_hashes` found for it (same inode, size and mtime), else read."""
    st = os.stat(path)
    return known.get((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)) or sha256_file(path)


def hash_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def list_files(root: Path) -> list[Path]:
    """Every regular file below root (following links to files), sorted, as relative paths."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        for name in sorted(filenames):
            out.append((Path(dirpath) / name).relative_to(root))
    return out


class ContentHasher:
    """sha256 of files and folders, memoized by (path, size, mtime_ns) in a small JSON file."""

    def __init__(self, memo_path: Path):
        self.memo_path = memo_path
        try:
            self.memo = json.loads(memo_path.read_text())
        except (OSError, ValueError):
            self.memo = {}
        self.dirty = False

    def file(self, path: Path) -> str:
        path = Path(path).resolve()
        st = path.stat()
        k = f"{path}|{st.st_size}|{st.st_mtime_ns}"
        if k not in self.memo:
            self.memo[k] = sha256_file(path)
            self.dirty = True
        return self.memo[k]

    def tree(self, path: Path) -> str:
        """Hash of a file, or of a folder's relative names and file contents."""
        path = Path(path)
        if path.is_file():
            return self.file(path)
        h = hashlib.sha256()
        for rel in list_files(path):
            if rel.parts[0] in (".git", ".cache") or rel.name.startswith(".nfs"):
                continue
            h.update(str(rel).encode() + b"\0" + self.file(path / rel).encode() + b"\n")
        return h.hexdigest()

    def save(self) -> None:
        if not self.dirty:
            return
        self.memo_path.parent.mkdir(parents=True, exist_ok=True)
        # per process and thread: a matrix runs its recipes' runners side by side in one process
        tmp = self.memo_path.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")
        tmp.write_text(json.dumps(self.memo))
        os.replace(tmp, self.memo_path)
        self.dirty = False


def default_root() -> Path:
    """The stage cache a recipe without cache_dir uses: $QUANTPIPE_CACHE, else ~/.cache/quantpipe."""
    return Path(os.environ.get("QUANTPIPE_CACHE", Path.home() / ".cache" / "quantpipe"))


class StageCache:
    def __init__(self, root: Path):
        self.root = Path(root)

    def entry(self, stage: str, key: str) -> Path:
        return self.root / "stages" / stage.replace(":", "/") / key

    def lookup(self, stage: str, key: str) -> dict | None:
        """The committed entry's marker, or None."""
        marker = self.entry(stage, key) / MARKER
        try:
            return json.loads(marker.read_text())
        except (OSError, ValueError):
            return None

    def begin(self, stage: str, key: str) -> Path:
        """A fresh private working folder for building the entry; its `out/` is the stage's output."""
        final = self.entry(stage, key)
        final.parent.mkdir(parents=True, exist_ok=True)
        work = final.parent / f".{key}.tmp-{os.getpid()}-{time.monotonic_ns()}"
        (work / "out").mkdir(parents=True)
        return work

    def commit(self, work: Path, stage: str, key: str, meta: dict, inputs=()) -> dict:
        """Hash the files, write the marker last, fsync, rename into place; files hard-linked from `inputs` reuse their hashes."""
        out = work / "out"
        known = recorded_hashes(inputs)
        files = {}
        for rel in list_files(out):
            p = out / rel
            if p.is_symlink() and not p.exists():
                raise OSError(f"dangling link in stage output: {rel}")
            st = p.stat()
            files[str(rel)] = {"size": st.st_size, "sha256": file_sha256(p, known), "mtime_ns": st.st_mtime_ns}
        marker = {**meta, "stage": stage, "key": key, "files": files, "committed_at": time.time()}
        _fsync_tree(out)
        tmp = work / (MARKER + ".tmp")
        with open(tmp, "w") as f:
            json.dump(marker, f, indent=2, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, work / MARKER)
        final = self.entry(stage, key)
        if final.exists():  # a stale or corrupt entry being rebuilt
            trash = final.parent / f".{key}.old-{os.getpid()}-{time.monotonic_ns()}"
            os.rename(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(work, final)
        _fsync_dir(final.parent)
        return marker

    def verify_entry(self, stage: str, key: str, marker: dict, full: bool = True) -> list[str]:
        """Problems with a committed entry's files: missing, resized, or (full) changed content.
        `full` re-hashes only files whose mtime changed, unless $QUANTPIPE_VERIFY=full (16 GB: ~13 s a hit on an H200)."""
        out = self.entry(stage, key) / "out"
        every = os.environ.get("QUANTPIPE_VERIFY") == "full"
        problems = []
        for rel, rec in marker.get("files", {}).items():
            p = out / rel
            st = p.stat() if p.exists() else None
            if st is None:
                problems.append(f"{rel}: missing")
            elif st.st_size != rec["size"]:
                problems.append(f"{rel}: size {st.st_size} != recorded {rec['size']}")
            elif full and (every or st.st_mtime_ns != rec.get("mtime_ns")) and sha256_file(p) != rec["sha256"]:
                problems.append(f"{rel}: content changed (sha256 mismatch)")
        recorded = set(marker.get("files", {}))
        extra = [str(r) for r in list_files(out) if str(r) not in recorded] if out.exists() else []
        problems += [f"{rel}: not written by the stage" for rel in extra]
        return problems

    def discard(self, stage: str, key: str) -> None:
        final = self.entry(stage, key)
        if final.exists():
            trash = final.parent / f".{key}.bad-{os.getpid()}-{time.monotonic_ns()}"
            os.rename(final, trash)
            shutil.rmtree(trash, ignore_errors=True)

    def lock(self, stage: str, key: str) -> FileLock:
        """The entry's lock: held while a run builds the entry and while prune takes it out."""
        return FileLock(str(self.entry(stage, key)) + ".lock")

    def entries(self) -> list[tuple[str, str]]:
        """(stage, key) of every committed entry, oldest commit first."""
        found = []
        for kind in sorted((self.root / "stages").glob("[!.]*")):
            for d in kind.glob("[!.]*"):
                if (d / MARKER).is_file():
                    found.append((kind.name, d.name, d))
                    continue
                found += [(f"{kind.name}:{d.name}", e.name, e) for e in d.glob("[!.]*") if (e / MARKER).is_file()]
        found.sort(key=lambda f: (_mtime(f[2] / MARKER), f[0], f[1]))
        return [(stage, key) for stage, key, _ in found]

    def take_out(self, stage: str, key: str) -> Path | None:
        """Rename the entry, under its lock, to a leftover name that `sweep()` knows and return it for deleting; None
        when another process holds the lock (a run building the entry, or waiting to reuse it)."""
        final = self.entry(stage, key)
        try:
            with self.lock(stage, key).acquire(timeout=0):
                trash = final.parent / f".{key}.bad-{os.getpid()}-{time.monotonic_ns()}"
                os.rename(final, trash)
                _fsync_dir(final.parent)
                return trash
        except Timeout:
            return None

    @contextmanager
    def runs_locked(self):
        """Hold runs.jsonl's lock: no run starts (registers its keys) meanwhile."""
        self.root.mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.root / RUNS_LOG) + ".lock"):
            yield

    def log_run(self, line: dict) -> None:
        """Append one line to runs.jsonl, whole (one write under its lock): a run's start, with its pid and the keys
        of every stage it uses, or its end, with its status."""
        data = (json.dumps(line, sort_keys=True, default=str) + "\n").encode()
        with self.runs_locked():
            fd = os.open(self.root / RUNS_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)

    def runs(self) -> list[dict]:
        """The runs runs.jsonl records, in start order, each run's lines merged (by output_dir and run_id)."""
        runs: dict[tuple, dict] = {}
        try:
            lines = (self.root / RUNS_LOG).read_text().splitlines()
        except OSError:
            return []
        for line in lines:
            try:
                rec = json.loads(line)
                who = (rec["output_dir"], rec["run_id"])
            except (ValueError, KeyError, TypeError):
                continue  # a line torn by a full disk
            runs[who] = {**runs.get(who, {}), **rec}
        return list(runs.values())

    def sweep(self) -> None:
        """Remove working folders and half-deleted entries left by runs that died (their pid is gone)."""
        stages = self.root / "stages"
        if not stages.exists():
            return
        for p in stages.glob("**/.*"):
            m = _LEFTOVER.search(p.name)
            if m and p.is_dir() and not alive(int(m.group(1))):
                shutil.rmtree(p, ignore_errors=True)


def inodes(dirs) -> dict:
    """Every file below `dirs` once per inode: (dev, inode) -> [size, links it has, links to it found below `dirs`]."""
    seen: dict[tuple, list] = {}
    for d in dirs:
        for dirpath, _, filenames in os.walk(d):
            for name in filenames:
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except OSError:
                    continue
                seen.setdefault((st.st_dev, st.st_ino), [st.st_size, st.st_nlink, 0])[2] += 1
    return seen


def freed_bytes(seen: dict) -> int:
    """The bytes deleting the trees `inodes()` walked gives back: files with no link left elsewhere."""
    return sum(size for size, nlink, found in seen.values() if found >= nlink)


def _mtime(p: Path) -> int:
    try:
        return p.stat().st_mtime_ns
    except OSError:
        return 0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            p = Path(dirpath) / name
            if p.is_symlink():
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))
