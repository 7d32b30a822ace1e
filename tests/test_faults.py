"""Faults injected into real runs on the tiny models (CPU, real stages, `quantpipe run` as a subprocess).

- kill -9 of the run at four points (merge writing its weights, quantization under way, packaging
  writing its files, the vLLM benchmark server up and serving) and SIGTERM during quantization: the next
  run reuses every committed stage, redoes the interrupted one, never publishes a partial package, and no
  stage, server or engine process outlives the killed run;
- two runs on one output directory (the second exits with a clear message, or queues with --wait) and a
  third on another output directory sharing the cache (waits for the entry, builds nothing twice);
- corrupted cache entries (truncated safetensors, a deleted file, a flipped byte): detected on use,
  named in a warning, rebuilt;
- the disk filling up while a stage saves (a small tmpfs holds the cache): a clear error naming the
  stage and the path, nothing half-committed, and a clean rebuild once there is space;
- a stage worker killed as the kernel's OOM killer does (SIGKILL): named with the signal and its log
  tail, the run exits 1, the other artifact is still built and published.

Kill points are reached by watching what a user could watch (the cache's working folders, the stage
logs, the server's log and port), never by hooks in quantpipe. Where a point lasts only milliseconds
(a tiny model's save) the stage's process group is frozen (SIGSTOP) the moment it is seen, the run is
killed, and the group is let go (SIGCONT): what follows is exactly what a kill at that moment does.
Every process a test starts carries a marker in its environment, so whatever outlives a run is found
wherever it was re-parented.

    .venv/quantize/bin/python -m pytest tests/test_faults.py -m slow --durations=0
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import yaml

from quantpipe.cache import StageCache
from quantpipe.ports import port_freed, port_in_use

REPO = Path(__file__).resolve().parents[1]
MARK = "QUANTPIPE_FAULT_TEST"  # every process a test run starts inherits it


# --- runs as a user starts them -------------------------------------------------------------------


def write_recipe(path: Path, tiny, cache: Path, out: Path, **over) -> Path:
    d = {
        "name": "faults",
        "output_dir": str(out),
        "cache_dir": str(cache),
        "base": {"model": str(tiny.llama)},
        "adapters": [{"path": str(tiny.llama_lora)}],
        "artifacts": [{"name": "fp8", "method": "fp8"}],
        "benchmark": {"enabled": False},
    }
    d.update(over)
    path.write_text(yaml.safe_dump(d))
    return path


class Run:
    """One `quantpipe run` process, its output in files, every descendant marked."""

    def __init__(self, recipe: Path, *args: str, tmp: Path, label: str, env: dict | None = None):
        self.mark = uuid.uuid4().hex
        self.label = label
        self.err_path = tmp / f"{label}.stderr"
        (tmp / "tmp").mkdir(exist_ok=True)
        env = {**os.environ, **(env or {}), MARK: self.mark, "TMPDIR": str(tmp / "tmp")}
        with open(tmp / f"{label}.stdout", "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "quantpipe", "run", str(recipe), *args],
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                env=env,
            )
        self.out_dir = Path(yaml.safe_load(recipe.read_text())["output_dir"])

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait(self, timeout_s: float = 900) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"run {self.label} still running after {timeout_s:.0f} s:\n{self.stderr()[-3000:]}")

    def run_dir(self) -> Path | None:
        found = list((self.out_dir / "runs").glob(f"*-{self.proc.pid}"))
        return found[0] if found else None

    def record(self) -> dict:
        d = self.run_dir()
        assert d is not None, f"run {self.label} wrote no run directory:\n{self.stderr()[-3000:]}"
        return json.loads((d / "run.json").read_text())

    def processes(self) -> list[psutil.Process]:
        """Live processes started by this run, wherever they were re-parented (zombies excluded)."""
        return marked(self.mark)

    def worker(self, stage: str) -> psutil.Process | None:
        """The worker process running `stage` (its spec lives in the stage's cache working folder)."""
        needle = "/stages/" + stage.replace(":", "/") + "/"
        for p in self.processes():
            try:
                cmd = p.cmdline()
            except psutil.Error:
                continue
            if any(a.endswith("worker.py") for a in cmd) and needle in cmd[-1]:
                return p
        return None

    def until(self, what: str, cond, timeout_s: float = 600, every_s: float = 0.01):
        """Poll cond() until it returns something true; fail if the run ends first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            v = cond()
            if v:
                return v
            if self.proc.poll() is not None:
                pytest.fail(
                    f"run {self.label} ended (exit {self.proc.returncode}) before {what}:\n{self.stderr()[-3000:]}"
                )
            time.sleep(every_s)
        pytest.fail(f"run {self.label}: no {what} after {timeout_s:.0f} s:\n{self.stderr()[-3000:]}")

    def stop(self, sig: int = signal.SIGKILL, freeze: psutil.Process | None = None) -> None:
        """Send `sig` to the run (kill -9 by default). With `freeze`, that stage worker's process group is
        stopped first and let go after, so the signal lands exactly where the stage was when it was seen."""
        if freeze is not None:
            os.killpg(freeze.pid, signal.SIGSTOP)  # a worker leads its own process group
        self.proc.send_signal(sig)
        if sig == signal.SIGKILL:
            self.proc.wait()
        else:
            time.sleep(0.5)  # let the run act on the signal while the stage is still frozen
        if freeze is not None:
            try:
                os.killpg(freeze.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def marked(mark: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and p.pid != os.getpid() and p.environ().get(MARK) == mark:
                out.append(p)
        except psutil.Error:
            pass
    return out


def gone(run: Run, timeout_s: float = 30) -> list[str]:
    """Wait for every process of a run to end; what is still alive after timeout_s, described."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = run.processes()
        if not left:
            return []
        time.sleep(0.25)
    desc = []
    for p in run.processes():
        try:
            desc.append(f"{p.pid} {' '.join(p.cmdline())[:160]}")
        except psutil.Error:
            pass
    return desc


@pytest.fixture
def runs(tmp_path):
    """Start runs with runs(recipe, *args, label=...); whatever a failed test leaves running is killed."""
    started: list[Run] = []

    def start(recipe: Path, *args: str, label: str, env: dict | None = None) -> Run:
        r = Run(recipe, *args, tmp=tmp_path, label=label, env=env)
        started.append(r)
        return r

    yield start
    for r in started:
        for p in r.processes():  # only processes carrying this run's own marker
            try:
                p.kill()
            except psutil.Error:
                pass


# --- the cache as the tests see it -----------------------------------------------------------------


def committed(cache: Path) -> dict[str, Path]:
    """stage id -> committed entry folder (a folder with its marker, not a working or trash folder)."""
    out = {}
    for marker in (cache / "stages").glob("**/entry.json"):
        entry = marker.parent
        rel = entry.relative_to(cache / "stages")
        if any(part.startswith(".") for part in rel.parts):
            continue
        out[":".join(rel.parts[:-1])] = entry
    return out


def working(cache: Path, stage: str) -> list[Path]:
    return list((cache / "stages" / stage.replace(":", "/")).glob(".*.tmp-*"))


def tmp_files(cache: Path, stage: str, pattern: str = "*") -> list[Path]:
    return [p for w in working(cache, stage) for p in (w / "out").glob(pattern)]


def leftovers(cache: Path) -> list[Path]:
    """Working, trash or half-deleted folders anywhere in the cache."""
    return [p for p in (cache / "stages").glob("**/.*") if re.search(r"\.(tmp|old|bad)-\d+", p.name)]


def states(rec: dict) -> dict[str, str]:
    return {k: v.get("cache") or v["status"] for k, v in rec["stages"].items()}


def assert_entries_verify(cache: Path) -> None:
    c = StageCache(cache)
    for stage, entry in committed(cache).items():
        marker = json.loads((entry / "entry.json").read_text())
        assert c.verify_entry(stage, entry.name, marker) == [], stage


def sha256s(entry: Path) -> dict[str, str]:
    return {f: v["sha256"] for f, v in json.loads((entry / "entry.json").read_text())["files"].items()}


def verify_package(path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "quantpipe", "verify", str(path)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr


def copy_cache(src: Path, dst: Path, stages: tuple[str, ...]) -> Path:
    """A private copy of some committed entries (a cache is plain folders; keys do not depend on where it lives)."""
    dst.mkdir(parents=True, exist_ok=True)
    if (src / "hashes.json").exists():
        shutil.copy2(src / "hashes.json", dst / "hashes.json")
    for stage, entry in committed(src).items():
        if stage.split(":")[0] in stages:
            target = dst / entry.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(entry, target, symlinks=True)
    return dst


@pytest.fixture(scope="module")
def built(tiny, tmp_path_factory):
    """One complete run (merge, quantize fp8, package) whose cache the other tests copy from."""
    tmp = tmp_path_factory.mktemp("built")
    recipe = write_recipe(tmp / "r.yaml", tiny, tmp / "cache", tmp / "out")
    r = Run(recipe, tmp=tmp, label="built")
    assert r.wait() == 0, r.stderr()[-3000:]
    assert set(committed(tmp / "cache")) == {"merge", "quantize:fp8", "package:fp8"}
    return SimpleNamespace(cache=tmp / "cache", record=r.record())


# --- kill -9 anywhere, then resume -------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.long
def test_kill_at_each_stage_then_resume(tiny, tmp_path, runs):
    """kill -9 while merge writes its weights, SIGTERM and kill -9 during quantization, kill -9 while the
    package is written; each time nothing of the run is left running and nothing partial is committed or
    published; then a run completes reusing every committed stage."""
    cache, out = tmp_path / "cache", tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", tiny, cache, out)
    pkg_link = out / "packages" / "fp8"

    def after_kill(run: Run, committed_now: set[str]) -> None:
        assert gone(run) == [], f"{run.label}: processes outlived the killed run"
        assert set(committed(cache)) == committed_now, run.label
        assert not pkg_link.exists() and not pkg_link.is_symlink(), f"{run.label}: a package was published"

    # 1. kill -9 while merge writes model.safetensors into its working folder
    a = runs(recipe, label="a-merge-save")
    w = a.until("merge worker", lambda: a.worker("merge"))
    a.until("merge weights being written", lambda: tmp_files(cache, "merge", "*.safetensors"))
    a.stop(signal.SIGKILL, freeze=w)
    after_kill(a, set())
    assert a.record()["status"] == "running"  # it never got to close its record; the next run does

    # 2. SIGTERM during quantization (what CI timeouts and systemd send): stopped cleanly, exit 130
    b = runs(recipe, label="b-quantize-sigterm")
    w = b.until("quantize worker", lambda: b.worker("quantize:fp8"))
    b.until("quantization under way", lambda: QUANTIZING in _log(b, "quantize_fp8"))
    t0 = time.monotonic()
    b.stop(signal.SIGTERM, freeze=w)
    assert b.wait(60) == 130, b.stderr()[-2000:]
    assert time.monotonic() - t0 < 8, "the run took too long to stop"
    assert "interrupted" in b.stderr() and "FAILED" not in b.stderr(), b.stderr()[-2000:]  # stopped, not failed
    after_kill(b, {"merge"})
    rec_b = b.record()
    assert states(rec_b) == {"merge": "miss"} and rec_b["status"] == "interrupted"  # merge redone after 1.
    assert not working(cache, "quantize:fp8"), "the interrupted stage's working folder was left behind"

    # 3. kill -9 during quantization
    c = runs(recipe, label="c-quantize-kill")
    w = c.until("quantize worker", lambda: c.worker("quantize:fp8"))
    c.until("quantization under way", lambda: QUANTIZING in _log(c, "quantize_fp8"))
    c.stop(signal.SIGKILL, freeze=w)
    after_kill(c, {"merge"})
    assert states(c.record()) == {"merge": "hit"}

    # 4. kill -9 while the package stage writes its files
    d = runs(recipe, label="d-package-write")
    w = d.until("package worker", lambda: d.worker("package:fp8"))
    d.until("package files being written", lambda: tmp_files(cache, "package:fp8"))
    d.stop(signal.SIGKILL, freeze=w)
    after_kill(d, {"merge", "quantize:fp8"})
    assert states(d.record()) == {"merge": "hit", "quantize:fp8": "miss"}

    # what a run killed while publishing (copying the package out of the cache, milliseconds here) leaves
    half = out / "packages" / ".store" / ".fp8.tmp-999999999"
    half.mkdir(parents=True)
    (half / "model.safetensors").write_bytes(b"half")
    (out / "packages" / ".fp8.link-999999999").symlink_to(".store/.fp8.tmp-999999999")

    # 5. the next run: committed stages reused, the interrupted one redone, the package published whole
    e = runs(recipe, label="e-resume")
    assert e.wait() == 0, e.stderr()[-3000:]
    rec = e.record()
    assert states(rec) == {"merge": "hit", "quantize:fp8": "hit", "package:fp8": "miss"}
    assert rec["status"] == "ok" and pkg_link.is_symlink()
    verify_package(pkg_link)
    assert leftovers(cache) == [], "working folders of the killed runs were not swept"
    assert_entries_verify(cache)
    assert sorted(p.name for p in (out / "packages").iterdir()) == [".store", "fp8"]
    assert [p.name for p in (out / "packages" / ".store").iterdir() if p.name.startswith(".")] == []
    assert gone(e) == []
    # the killed runs are closed by the next run, not left "running" forever
    for killed in (a, c, d):
        assert killed.record()["status"] == "killed", killed.label
    index = [json.loads(x) for x in (out / "runs" / "index.jsonl").read_text().splitlines()]
    assert sorted(i["status"] for i in index) == ["interrupted", "killed", "killed", "killed", "ok"]


QUANTIZING = "Compression lifecycle"  # llm-compressor's log line as oneshot starts


def _log(run: Run, name: str) -> str:
    d = run.run_dir()
    try:
        return (d / "logs" / f"{name}.log").read_text(errors="replace") if d else ""
    except OSError:
        return ""


SMALL_BENCH = {  # one short sweep point on a small fixed KV cache: a server up in seconds, measured in seconds
    "engine": {"enforce_eager": True, "max_model_len": 128, "kv_cache_memory_bytes": 128 * 2**20},
    "workloads": [{"name": "fixed", "input_len": 16, "output_len": 4, "num_prompts": 2}],
    "concurrency": [1],
    "offline": False,
    "lora": False,
}


@pytest.mark.slow
@pytest.mark.long
def test_kill_while_the_benchmark_server_is_up(tiny, built, tmp_path, runs):
    """kill -9 of the run while the benchmark stage's vLLM server is up: the stage, the server and its
    engine process all end, the port is free; the next run redoes the benchmark and publishes the package."""
    cache = copy_cache(built.cache, tmp_path / "cache", ("merge", "quantize"))
    recipe = write_recipe(tmp_path / "r.yaml", tiny, cache, tmp_path / "out", benchmark=SMALL_BENCH)
    a = runs(recipe, label="a-server-up")

    def server_up():
        for log in tmp_files(cache, "benchmark:baseline", "logs/server-default.log"):
            text = log.read_text(errors="replace")
            m = re.search(r"Starting vLLM server on http://127\.0\.0\.1:(\d+)", text)
            if m and "Application startup complete" in text:
                return int(m.group(1))
        return None

    port = a.until("a healthy benchmark server", server_up, timeout_s=600, every_s=0.5)
    assert port_in_use(port)
    # the runner, the worker, the API server and the engine core at least
    assert len(a.processes()) >= 4, [p.cmdline()[:3] for p in a.processes()]
    a.stop(signal.SIGKILL)  # no freeze: the server is up for many seconds
    assert gone(a, 60) == [], "stage, server or engine processes outlived the killed run"
    assert port_freed(port), f"port {port} still served after the run was killed"
    assert set(committed(cache)) == {"merge", "quantize:fp8"}
    assert not (tmp_path / "out" / "packages").exists()

    b = runs(recipe, label="b-resume")
    assert b.wait() == 0, b.stderr()[-3000:]
    rec = b.record()
    assert states(rec) == {
        "merge": "hit",
        "benchmark:baseline": "miss",
        "quantize:fp8": "hit",
        "benchmark:fp8": "miss",
        "package:fp8": "miss",
    }
    verify_package(tmp_path / "out" / "packages" / "fp8")
    assert gone(b) == [] and leftovers(cache) == []


@pytest.mark.slow
@pytest.mark.long
def test_a_server_killed_mid_run_fails_its_stage_caches_nothing_and_is_measured_again(tiny, built, tmp_path, runs):
    """SIGKILL of the baseline's vLLM server alone, once it serves: a fault, not a verdict. The run goes on with the
    other artifact, exits 1, names the stage and the cause; nothing of the killed benchmark is cached; the unchanged
    re-run measures exactly that stage again (and builds the package that waited for it), reusing everything else."""
    cache = copy_cache(built.cache, tmp_path / "cache", ("merge", "quantize"))
    recipe = write_recipe(tmp_path / "r.yaml", tiny, cache, tmp_path / "out", benchmark=SMALL_BENCH)
    a = runs(recipe, label="a-server-killed")

    def serving():
        for log in tmp_files(cache, "benchmark:baseline", "logs/server-default.log"):
            if "Application startup complete" in log.read_text(errors="replace"):
                return next(
                    (p for p in a.processes() if "serve" in _cmd(p) and "vllm.entrypoints.cli.main" in _cmd(p)), None
                )
        return None

    a.until("the baseline's server serving", serving, timeout_s=600, every_s=0.5).kill()
    assert a.wait() == 1, a.stderr()[-3000:]
    rec = a.record()
    b = rec["stages"]["benchmark:baseline"]
    assert b["status"] == "failed" and b["fault"] is True and "it was killed" in b["error"], b
    assert "nothing of this benchmark is kept" in b["error"]
    assert any("benchmark:baseline" in ln and "FAILED" in ln and "killed" in ln for ln in a.stderr().splitlines())
    assert rec["stages"]["benchmark:fp8"]["status"] == "ok" and "benchmark:baseline" not in committed(cache)
    assert rec["command"] == f"quantpipe run {recipe}"  # the command line as typed, for the report's provenance
    assert gone(a) == [] and leftovers(cache) == []

    again = runs(recipe, label="b-again")
    assert again.wait() == 0, again.stderr()[-3000:]
    # exactly the failed stage, and the package that waited for it (its card compares with the baseline's figures)
    assert rec["stages"]["package:fp8"]["status"] == "skipped"
    rebuilt = {k: v for k, v in states(again.record()).items() if v != "hit"}
    assert rebuilt == {"benchmark:baseline": "miss", "package:fp8": "miss"}


def _cmd(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


# --- two runs at once --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.long
def test_two_runs_at_once(tiny, built, tmp_path, runs):
    """A second run of the same output directory exits 2 with a clear message; one with --wait queues
    behind the first; a run of another output directory sharing the cache waits for the entry being
    built instead of building it again. Cache and packages end up whole."""
    cache = copy_cache(built.cache, tmp_path / "cache", ("merge",))
    recipe = write_recipe(tmp_path / "r.yaml", tiny, cache, tmp_path / "out")
    other = write_recipe(tmp_path / "r2.yaml", tiny, cache, tmp_path / "out2")

    a = runs(recipe, label="a-first")
    a.until("quantize worker", lambda: a.worker("quantize:fp8"))
    b = runs(recipe, label="b-no-wait")
    assert b.wait(120) == 2
    assert "another quantpipe run is using" in b.stderr() and "--wait" in b.stderr(), b.stderr()
    assert "Traceback" not in b.stderr() and b.run_dir() is None  # nothing written
    c = runs(recipe, "--wait", label="c-wait")
    d = runs(other, label="d-other-output")
    time.sleep(3)
    assert a.proc.poll() is None, "the first run ended too soon for the test to overlap it"
    assert c.proc.poll() is None and c.run_dir() is None, "--wait did not queue behind the running run"
    for r in (a, c, d):
        assert r.wait() == 0, f"{r.label}:\n{r.stderr()[-3000:]}"
    rec_a, rec_c, rec_d = a.record(), c.record(), d.record()
    # each stage built once: quantize by a (it held the entry when d came), package by whichever got there first
    assert states(rec_a)["quantize:fp8"] == "miss" and states(rec_d)["quantize:fp8"] == "hit"
    assert sorted([states(rec_a)["package:fp8"], states(rec_d)["package:fp8"]]) == ["hit", "miss"], (
        "a stage was built twice"
    )
    assert not (d.run_dir() / "logs" / "quantize_fp8.log").exists()
    assert set(states(rec_c).values()) == {"hit"} and rec_c["started_at"] >= rec_a["finished_at"]
    verify_package(tmp_path / "out" / "packages" / "fp8")
    verify_package(tmp_path / "out2" / "packages" / "fp8")
    assert_entries_verify(cache)
    assert leftovers(cache) == []


# --- corrupted cache entries ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.long
def test_corrupted_entries_are_named_and_rebuilt(tiny, built, tmp_path, runs):
    """Truncated safetensors (merge), a deleted file (quantize), a flipped byte (package): each is found
    when the run uses the entry, named in a warning, and rebuilt to the same content."""
    cache = copy_cache(built.cache, tmp_path / "cache", ("merge", "quantize", "package"))
    entries = committed(cache)
    before = {s: sha256s(e) for s, e in entries.items()}
    merged = entries["merge"] / "out" / "model.safetensors"
    with open(merged, "r+b") as f:
        f.truncate(merged.stat().st_size // 2)
    (entries["quantize:fp8"] / "out" / "config.json").unlink()
    weights = sorted((entries["package:fp8"] / "out").glob("*.safetensors"))[0]
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))

    recipe = write_recipe(tmp_path / "r.yaml", tiny, cache, tmp_path / "out")
    r = runs(recipe, label="corrupt")
    assert r.wait() == 0, r.stderr()[-3000:]
    err = r.stderr()
    for stage, what in (
        ("merge", "model.safetensors: size"),
        ("quantize:fp8", "config.json: missing"),
        ("package:fp8", f"{weights.name}: content changed"),
    ):
        assert any(stage in ln and what in ln and "corrupt" in ln for ln in err.splitlines()), (stage, err)
    assert states(r.record()) == {"merge": "rebuilt", "quantize:fp8": "rebuilt", "package:fp8": "rebuilt"}
    assert_entries_verify(cache)
    after = {s: sha256s(e) for s, e in committed(cache).items()}
    assert after["merge"] == before["merge"]  # the rebuild is faithful: same bytes as the first build
    verify_package(tmp_path / "out" / "packages" / "fp8")
    run_log = (r.run_dir() / "run.log").read_text()
    assert len(re.findall(r"WARNING quantpipe.run.runner: cache entry \S+ is corrupt", run_log)) == 3


# --- a full disk --------------------------------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path):
    """small_fs(size) -> a fresh tmpfs of that size (e.g. "256m"): a disk the test can fill."""
    mounted = []

    def mount(size: str) -> Path:
        mnt = tmp_path / f"fs{len(mounted)}"
        mnt.mkdir()
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "quantpipe-test", str(mnt)], capture_output=True, text=True
        )
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN): {r.stderr.strip()}")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(fs: Path, leave_bytes: int) -> Path:
    """Take all but leave_bytes of fs's free space with one file."""
    st = os.statvfs(fs)
    free = st.f_bavail * st.f_frsize
    filler = fs / "filler"
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, max(free - leave_bytes, 0))
    return filler


@pytest.mark.slow
@pytest.mark.long
def test_disk_full_while_a_stage_saves(tiny, built, tmp_path, small_fs, runs):
    """The cache's disk fills up while quantize runs: the run names the stage and the path, exits 1,
    commits nothing half-written, leaves no working folder; with space again the stage is rebuilt."""
    fs = small_fs("256m")
    cache = copy_cache(built.cache, fs / "cache", ("merge",))
    recipe = write_recipe(tmp_path / "r.yaml", tiny, cache, tmp_path / "out")
    r = runs(recipe, label="full")
    r.until("quantize worker", lambda: r.worker("quantize:fp8"))
    filler = fill(fs, 512 * 1024)  # another process takes the space: the save cannot fit
    assert r.wait() == 1
    err = r.stderr()
    line = next((ln for ln in err.splitlines() if "quantize:fp8" in ln and "FAILED" in ln), "")
    assert "no space left" in line.lower() and str(cache) in line, err[-3000:]
    assert "Traceback" not in line
    rec = r.record()
    assert rec["stages"]["quantize:fp8"]["status"] == "failed" and str(cache) in rec["stages"]["quantize:fp8"]["error"]
    assert rec["stages"]["package:fp8"]["status"] == "skipped"
    assert set(committed(cache)) == {"merge"} and leftovers(cache) == []
    assert not (tmp_path / "out" / "packages" / "fp8").exists()
    assert gone(r) == []

    filler.unlink()
    again = runs(recipe, label="space-again")
    assert again.wait() == 0, again.stderr()[-3000:]
    assert states(again.record()) == {"merge": "hit", "quantize:fp8": "miss", "package:fp8": "miss"}
    assert_entries_verify(cache)


@pytest.mark.slow
@pytest.mark.long
def test_output_disk_too_small_for_the_package(tiny, built, tmp_path, small_fs, runs):
    """Every stage is cached but the output directory's disk cannot hold the package: publishing fails
    naming the artifact and the path, the run exits 1, no half copy or link is left, the cache is whole."""
    cache = copy_cache(built.cache, tmp_path / "cache", ("merge", "quantize", "package"))
    out = small_fs("4m") / "out"
    package_bytes = sum(p.stat().st_size for p in (committed(cache)["package:fp8"] / "out").rglob("*") if p.is_file())
    assert package_bytes > 4 * 2**20  # the package cannot fit, the run's own records can
    recipe = write_recipe(tmp_path / "r.yaml", tiny, cache, out)
    # pre-flight may see this coming; a disk that fills after it must still fail cleanly at publishing
    r = runs(recipe, label="publish-full", env={"QUANTPIPE_PREFLIGHT": "off"})
    assert r.wait() == 1, r.stderr()[-3000:]
    line = next((ln for ln in r.stderr().splitlines() if "publish:fp8" in ln and "FAILED" in ln), "")
    assert str(out / "packages" / "fp8") in line and "No space left" in line and len(line) < 600, r.stderr()[-3000:]
    rec = r.record()
    assert (
        rec["status"] == "failed"
        and "package" not in rec["artifacts"]["fp8"]
        and rec["artifacts"]["fp8"]["package_error"]
    )
    assert not (out / "packages" / "fp8").exists() and not (out / "packages" / "fp8").is_symlink()
    assert list((out / "packages" / ".store").iterdir()) == [] and list((out / "packages").glob(".fp8.link-*")) == []
    assert set(states(rec).values()) == {"hit"}
    assert_entries_verify(cache)


# --- a crashed or out-of-memory stage -----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.long
def test_a_killed_stage_is_reported_and_the_others_kept(tiny, built, tmp_path, runs):
    """quantize:a's worker is SIGKILLed mid-quantization, as the kernel's OOM killer does: the run names the
    stage, the signal and its log tail, exits 1, still builds and publishes artifact b, and writes the report."""
    cache = copy_cache(built.cache, tmp_path / "cache", ("merge",))
    arts = [{"name": n, "method": "fp8"} for n in ("a", "b")]
    recipe = write_recipe(tmp_path / "r.yaml", tiny, cache, tmp_path / "out", artifacts=arts)
    r = runs(recipe, label="crash")
    wa = r.until("quantize:a worker", lambda: r.worker("quantize:a"))
    r.until("quantization of a under way", lambda: QUANTIZING in _log(r, "quantize_a"))
    wa.send_signal(signal.SIGSTOP)  # hold it where it was seen...
    wa.kill()  # ...and SIGKILL the worker alone
    assert r.wait() == 1
    rec = r.record()
    a = rec["stages"]["quantize:a"]
    assert a["status"] == "failed" and a["error"].startswith("killed by SIGKILL") and QUANTIZING in a["log_tail"]
    assert any("quantize:a" in ln and "FAILED" in ln and "killed by SIGKILL" in ln for ln in r.stderr().splitlines()), (
        r.stderr()[-3000:]
    )
    assert rec["stages"]["package:a"]["status"] == "skipped"
    assert rec["stages"]["quantize:b"]["status"] == "ok" and rec["stages"]["package:b"]["status"] == "ok"
    assert rec["status"] == "failed" and rec.get("report") and rec["artifacts"]["b"]["package"]
    verify_package(tmp_path / "out" / "packages" / "b")
    assert not (tmp_path / "out" / "packages" / "a").exists()
    assert set(committed(cache)) == {"merge", "quantize:b", "package:b"} and leftovers(cache) == []
    assert gone(r) == []


@pytest.mark.slow
@pytest.mark.long
def test_two_stages_at_once_stop_together_and_fail_alone(tiny, built, tmp_path, runs):
    """With a simulated GPU and --jobs 2, both artifacts quantize at once. SIGTERM of the run then stops both
    workers' process groups (exit 130, nothing committed, no working folder left); SIGKILL of one worker while
    the other runs fails that stage alone: the other is built and published; a third run completes."""
    cache = copy_cache(built.cache, tmp_path / "cache", ("merge",))
    arts = [{"name": n, "method": "fp8"} for n in ("a", "b")]
    recipe = write_recipe(tmp_path / "r.yaml", tiny, cache, tmp_path / "out", artifacts=arts)
    env = {"QUANTPIPE_GPUS": "1"}

    def hold_both(run: Run):
        """Stop each worker (SIGSTOP) the moment its log shows quantization under way, so that both are caught
        mid-quantization however much faster one of them is; returns the two held workers (a, b)."""
        held: dict[str, psutil.Process] = {}

        def catch():
            for n in "ab":
                w = held.get(n) or run.worker(f"quantize:{n}")
                if n not in held and w is not None and QUANTIZING in _log(run, f"quantize_{n}"):
                    w.send_signal(signal.SIGSTOP)
                    held[n] = w
            return len(held) == 2

        run.until("both quantize stages under way", catch, every_s=0.005)
        return held["a"], held["b"]

    r = runs(recipe, "--jobs", "2", label="sigterm-two", env=env)
    held = hold_both(r)
    r.stop(signal.SIGTERM)
    for w in held:
        w.send_signal(signal.SIGCONT)  # the forwarded SIGTERM is delivered as they go on
    assert r.wait(60) == 130, r.stderr()[-2000:]
    assert gone(r) == []
    assert set(committed(cache)) == {"merge"} and leftovers(cache) == []
    assert not working(cache, "quantize:a") and not working(cache, "quantize:b")

    k = runs(recipe, "--jobs", "2", label="kill-one", env=env)
    wa, wb = hold_both(k)
    wa.kill()
    wb.send_signal(signal.SIGCONT)
    assert k.wait() == 1
    rec = k.record()
    assert rec["stages"]["quantize:a"]["status"] == "failed" and rec["stages"]["quantize:a"]["error"].startswith(
        "killed by SIGKILL"
    )
    assert rec["stages"]["quantize:b"]["status"] == "ok" and rec["stages"]["package:b"]["status"] == "ok"
    a, b = rec["stages"]["quantize:a"], rec["stages"]["quantize:b"]
    assert a["start_s"] < b["end_s"] and b["start_s"] < a["end_s"], "the two quantize stages did not run at once"
    assert a["devices"] == b["devices"] == ["0"]  # packed on the one GPU
    verify_package(tmp_path / "out" / "packages" / "b")
    assert gone(k) == [] and leftovers(cache) == []

    c = runs(recipe, "--jobs", "2", label="complete", env=env)
    assert c.wait() == 0, c.stderr()[-3000:]
    assert states(c.record()) == {
        "merge": "hit",
        "quantize:a": "miss",
        "package:a": "miss",
        "quantize:b": "hit",
        "package:b": "hit",
    }
    assert gone(c) == []


# --- how a dying stage is described (fast) -------------------------------------------------------------


def test_out_of_disk_and_memory_are_named_wherever_they_surface(tmp_path):
    """The worker turns ENOSPC (as OSError, or as safetensors' Rust error) and allocation failures, also
    when wrapped by another exception, into one sentence; other errors are left to the traceback."""
    from quantpipe.worker import resource_error

    out = tmp_path / "out"
    e = resource_error(OSError(28, "No space left on device", str(out / "model.safetensors")), out)
    assert e.startswith("no space left") and str(out / "model.safetensors") in e and "MiB free" in e
    rust = RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert str(out) in resource_error(rust, out)
    try:
        try:
            raise MemoryError()
        except MemoryError as inner:
            raise ValueError("while compressing") from inner
    except ValueError as wrapped:
        assert resource_error(wrapped, out).startswith("out of memory (MemoryError")
    torch_oom = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1073741824 bytes.")
    assert resource_error(torch_oom, out).startswith("out of memory")
    assert resource_error(ValueError("group_size must divide 256"), out) is None


def test_a_stage_killed_by_a_signal_is_described_by_it():
    from quantpipe.run.process import exit_reason as _exit_reason

    assert _exit_reason(1) == "exit code 1"
    assert _exit_reason(-signal.SIGKILL).startswith("killed by SIGKILL (the kernel's out-of-memory killer")
    assert _exit_reason(-signal.SIGSEGV) == "killed by SIGSEGV"


def test_a_server_fault_is_told_apart_from_a_verdict_on_the_model():
    """Out of memory, a KV cache that does not fit, a kill, a hang or a death while serving are faults of the host (the
    stage fails and is retried); a kernel vLLM lacks at load is a verdict (recorded as not servable, cached)."""
    from quantpipe.server_output import fault_cause, fault_recorded_as_verdict

    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.96 GiB. GPU 0 has a total capacity of 79.19 GiB"
    assert fault_cause(oom) == "out of GPU memory"
    kv = "ValueError: To serve at least one request with the models's max seq len (2048), (0.25 GiB KV cache is needed, which is larger than the available KV cache memory (0.01 GiB)."
    assert fault_cause(kv) == "its KV cache does not fit"
    busy = "ValueError: Free memory on device (12.1/79.2 GiB) on startup is less than desired GPU memory utilization (0.9, 71.3 GiB)."
    assert fault_cause(busy) == "GPU memory taken by other processes"
    assert fault_cause("vllm serve was killed by SIGKILL; server exited; last log lines: ...") == "it was killed"
    assert fault_cause("vllm serve not healthy after 900 s") == "it did not become healthy in time"
    assert fault_cause("server exited; last log lines: INFO ...", started=True) == "it died while serving"
    kernel = "ValueError: Failed to find a kernel that can implement the WNA16 linear layer. Reasons: CPUWNA16 requires AVX-512"
    assert fault_cause(kernel) is None and fault_cause(kernel, "INFO loading weights\nINFO done") is None
    assert fault_recorded_as_verdict({"servable": False, "reason": f"not servable here: {oom}"}) == "out of GPU memory"
    assert fault_recorded_as_verdict({"servable": False, "reason": f"not servable here: {kernel}"}) is None
    assert (
        fault_recorded_as_verdict({"servable": True, "reason": None, "variants": {"eager": {"reason": None}}}) is None
    )


def test_a_benchmark_that_faulted_beside_others_is_retried_once_alone_with_its_evaluation():
    """The runner's retry rule: a benchmark (and its joint evaluation, held back until the benchmark's record comes)
    whose server faulted while it shared its GPU is queued again once, alone; a second fault, a fault of a stage that had
    its GPU to itself, or a failure that is no fault, is recorded as it is."""
    from quantpipe.run.dispatch import _Retry
    from quantpipe.run.record import StageRecord

    e = SimpleNamespace(id="evaluate:gptq", kind="evaluate", joint="benchmark:gptq")
    b = SimpleNamespace(id="benchmark:gptq", kind="benchmark", joint=None)
    by_id = {s.id: s for s in (e, b)}
    fault = StageRecord(kind="benchmark", status="failed", fault=True, error="out of GPU memory")
    r, failed = _Retry(), {e.id: "x", b.id: "x"}
    r.shared |= {e.id, b.id}
    assert r.again(e, fault.model_copy(update={"kind": "evaluate"}), by_id, failed) == [] and e.id not in failed
    assert r.again(b, fault, by_id, failed) == [e, b] and failed == {} and r.alone == {b.id}
    assert r.again(b, fault, by_id, failed) is None  # once
    r2 = _Retry()
    assert r2.again(b, fault, by_id, {}) is None  # it had its GPU to itself
    r2.shared.add(b.id)
    plain = fault.model_copy(update={"fault": None, "error": "StageError: bad workload"})
    assert r2.again(b, plain, by_id, {}) is None
    # an evaluation held back for a benchmark that is not retried is recorded as failed with it
    r3, failed3 = _Retry(), {}
    r3.shared |= {e.id, b.id}
    r3.again(e, fault.model_copy(update={"kind": "evaluate"}), by_id, failed3)
    held = r3.release(b.id, failed3)
    assert held[0] is e and failed3 == {e.id: "out of GPU memory"}
