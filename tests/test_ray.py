"""`quantpipe run --executor ray` on a real Ray cluster started on this host (no mocks).

The multi-node tests start a head and a second node with `ray.cluster_utils.Cluster` (one CPU and one GPU
resource each; `QUANTPIPE_GPUS=1x24` gives the nodes' simulated GPUs a size, so the quantize stage asks for
a fraction of one), bound to 127.0.0.1, with Ray's files in a short folder under /tmp (its socket paths
must stay under 108 characters). Each test runs `quantpipe run` as a subprocess against the cluster:

- a two-recipe matrix of the tiny model (a shared base and adapter, different artifacts): every entry is
  built once, the shared merge once, on both nodes; packages verify, reports and the index are written;
- a node without the environments is refused by its address before anything is written;
- a driver killed with kill -9 mid-stage leaves no stage running, and then two drivers on the one cache
  reuse every committed stage and build each missing entry once between them;
- a driver given SIGTERM or Ctrl-C (SIGINT) mid-stage stops its stages on the cluster, exits 130, records the
  run as interrupted and commits nothing of the stopped stage;
- the second node's raylet killed (SIGKILL) while it runs a quantize stage: Ray runs the stage again on the
  head, the run ends ok, nothing of the lost attempt is committed, and the run says how long it lost.

Every process the cluster starts carries a marker in its environment; the module's teardown stops the nodes
by their pids and then kills, by pid, anything still carrying the marker.

    .venv/quantize/bin/python -m pytest tests/test_ray.py -m long
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from click.testing import CliRunner
from helpers.fakes import safetensors
from helpers.ray_cluster import MARK, marked, ray_cluster

from quantpipe.cache import StageCache
from quantpipe.cli import main

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


# --- fast: no cluster --------------------------------------------------------------------------------


def test_the_local_executor_never_imports_ray(tmp_path):
    """A dry run and the runner, matrix and CLI modules leave Ray unimported unless --executor ray asks for it."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    safetensors(tmp_path / "m" / "model.safetensors", {"w": [1]})
    (tmp_path / "m" / "tokenizer_config.json").write_text("{}")
    (tmp_path / "r.yaml").write_text(
        yaml.safe_dump(
            {"name": "t", "output_dir": "out", "base": {"model": "m"}, "artifacts": [{"name": "f", "method": "fp8"}]}
        )
    )
    code = (
        "import sys; from click.testing import CliRunner; from quantpipe.cli import main; import quantpipe.run.matrix\n"
        f"r = CliRunner().invoke(main, ['run', '--dry-run', {str(tmp_path / 'r.yaml')!r}]); assert r.exit_code == 0, r.output\n"
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "QUANTPIPE_CACHE": str(tmp_path / "cache")},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_ray_options_are_refused_without_ray_and_an_unreachable_cluster_in_one_sentence(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    safetensors(tmp_path / "m" / "model.safetensors", {"w": [1]})
    (tmp_path / "m" / "tokenizer_config.json").write_text("{}")
    r = tmp_path / "r.yaml"
    r.write_text(
        yaml.safe_dump(
            {"name": "t", "output_dir": "out", "base": {"model": "m"}, "artifacts": [{"name": "f", "method": "fp8"}]}
        )
    )
    res = CliRunner().invoke(main, ["run", str(r), "--address", "127.0.0.1:1"])
    assert res.exit_code == 2 and "--executor ray" in res.output
    res = CliRunner().invoke(main, ["run", str(r), "--executor", "ray", "--gpus", "0"])
    assert res.exit_code == 2 and "drop --gpus" in res.output
    with socket_free() as port:
        res = CliRunner().invoke(
            main, ["run", str(r), "--executor", "ray", "--address", f"127.0.0.1:{port}", "--cache", str(tmp_path / "c")]
        )
    assert res.exit_code == 2 and "no Ray cluster answers there" in res.output, res.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "c").exists()


def test_two_recipes_with_one_output_dir_are_refused_before_anything_is_written(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    safetensors(tmp_path / "m" / "model.safetensors", {"w": [1]})
    (tmp_path / "m" / "tokenizer_config.json").write_text("{}")
    for n in ("a", "b"):
        (tmp_path / f"{n}.yaml").write_text(
            yaml.safe_dump(
                {"name": n, "output_dir": "out", "base": {"model": "m"}, "artifacts": [{"name": "f", "method": "fp8"}]}
            )
        )
    res = CliRunner().invoke(
        main, ["run", str(tmp_path / "a.yaml"), str(tmp_path / "b.yaml"), "--cache", str(tmp_path / "c")]
    )
    assert res.exit_code == 2 and "give each recipe its own output_dir" in res.output, res.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "c").exists()


def test_ray_requests_are_what_the_local_scheduler_would_grant():
    """Whole GPUs for a benchmark, a GPU fraction from the estimate for quantize and evaluate, none for merge and package,
    RAM as Ray memory; without GPUs every CPU of a node; a request no node could hold is named with the largest offer."""
    from quantpipe.run.ray_executor import RayCluster

    gib = 2**30
    c = RayCluster()
    c.nodes = {
        "a": {
            "alive": True,
            "resources": {"CPU": 16, "GPU": 2, "memory": 100 * gib},
            "gpus": [{"total_bytes": 80 * gib}] * 2,
        },
        "b": {
            "alive": True,
            "resources": {"CPU": 16, "GPU": 8, "memory": 200 * gib},
            "gpus": [{"total_bytes": 141 * gib}] * 8,
        },
        "gone": {"alive": False, "resources": {"CPU": 99, "GPU": 99}, "gpus": [{"total_bytes": 1 * gib}]},
    }
    assert c.request("benchmark", {"ram_bytes": 6 * gib}, tp=2) == {"num_cpus": 1, "num_gpus": 2, "memory": 6 * gib}
    assert (
        c.request("quantize", {"ram_bytes": 30 * gib, "gpu_bytes": 20 * gib})["num_gpus"] == 0.25
    )  # 20 of the smallest GPU's 80 GiB
    assert (
        c.request("evaluate", {"ram_bytes": 90 * gib})["num_gpus"] == 1
    )  # no GPU estimate: its RAM estimate, at most a whole GPU
    assert c.request("evaluate", {"ram_bytes": 100})["num_gpus"] == 0.01
    assert c.request("merge", {"ram_bytes": 40 * gib}) == {"num_cpus": 1, "num_gpus": 0, "memory": 40 * gib}
    assert c.infeasible("merge", c.request("merge", {"ram_bytes": 150 * gib})) is None  # node b holds it
    why = c.infeasible("merge", c.request("merge", {"ram_bytes": 300 * gib}))
    assert why.startswith("merge asks Ray for") and "memory 200.0 GiB" in why
    c.nodes = {
        "a": {"alive": True, "resources": {"CPU": 8, "memory": 32 * gib}},
        "b": {"alive": True, "resources": {"CPU": 4, "memory": 32 * gib}},
        "head": {"alive": True, "resources": {"CPU": 0}},
    }
    assert c.request("quantize", {"ram_bytes": gib}) == {
        "num_cpus": 4,
        "num_gpus": 0,
        "memory": gib,
    }  # a whole (the smallest) node


class socket_free:
    """A loopback port nothing listens on (bound, then closed)."""

    def __enter__(self) -> int:
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        return self.port

    def __exit__(self, *exc):
        return False


# --- a real cluster ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    """Two nodes, one CPU and one GPU resource each (simulated GPUs of 24 GiB: quantize asks for a fraction of one)."""
    with ray_cluster(2, num_cpus=1, num_gpus=1) as c:
        yield c


def write_recipe(path: Path, tiny, out: Path, *artifacts: dict, name: str | None = None) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "name": name or path.stem,
                "output_dir": str(out),
                "base": {"model": str(tiny.llama)},
                "adapters": [{"path": str(tiny.llama_lora)}],
                "artifacts": list(artifacts),
                "benchmark": {"enabled": False},
            }
        )
    )
    return path


def quantpipe(*args: str, cluster, tmp: Path, label: str) -> subprocess.Popen:
    env = {**os.environ, MARK: cluster.mark, "TMPDIR": str(tmp)}
    err = open(tmp / f"{label}.stderr", "w")
    return subprocess.Popen(
        [sys.executable, "-m", "quantpipe", "run", *args, "--executor", "ray", "--address", cluster.address],
        stdout=err,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
    )


def finish(p: subprocess.Popen, tmp: Path, label: str, timeout_s: float = 1200) -> tuple[int, str]:
    try:
        rc = p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail(f"{label} still running after {timeout_s:.0f} s:\n{(tmp / f'{label}.stderr').read_text()[-4000:]}")
    return rc, (tmp / f"{label}.stderr").read_text(errors="replace")


def record(out_dir: Path) -> dict:
    runs = sorted((out_dir / "runs").glob("*/run.json"))
    assert runs, f"no run record in {out_dir}"
    return json.loads(runs[-1].read_text())


def leftovers(cache: Path) -> list[Path]:
    """Working, trash or half-deleted folders of any executor anywhere in the cache."""
    return [p for p in (cache / "stages").glob("**/.*") if p.is_dir()]


def committed(cache: Path) -> dict[str, Path]:
    out = {}
    for marker in (cache / "stages").glob("**/entry.json"):
        rel = marker.parent.relative_to(cache / "stages")
        if not any(part.startswith(".") for part in rel.parts):
            out[":".join(rel.parts[:-1])] = marker.parent
    return out


def assert_entries_verify(cache: Path) -> None:
    c = StageCache(cache)
    for stage, entry in committed(cache).items():
        assert c.verify_entry(stage, entry.name, json.loads((entry / "entry.json").read_text())) == [], stage


def verify(package: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "quantpipe", "verify", str(package)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr


def built(rec: dict) -> dict[str, dict]:
    return {sid: st for sid, st in rec["stages"].items() if st.get("cache") in ("miss", "forced", "rebuilt")}


@pytest.mark.slow
def test_two_recipes_with_the_local_executor_share_the_merge_and_get_one_index(tiny, tmp_path):
    a = write_recipe(tmp_path / "ra.yaml", tiny, tmp_path / "out" / "ra", {"name": "fp8", "method": "fp8"})
    b = write_recipe(tmp_path / "rb.yaml", tiny, tmp_path / "out" / "rb", {"name": "rtn", "method": "rtn"})
    r = subprocess.run(
        [sys.executable, "-m", "quantpipe", "run", str(a), str(b), "--cache", str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    ra, rb = record(tmp_path / "out" / "ra"), record(tmp_path / "out" / "rb")
    assert (ra["stages"]["merge"]["cache"], rb["stages"]["merge"]["cache"]) == ("miss", "hit")
    index = json.loads((tmp_path / "out" / "matrix.json").read_text())
    assert [(e["name"], e["status"], e["reused"]) for e in index["recipes"]] == [
        ("ra", "ok", {}),
        ("rb", "ok", {"merge": "ra"}),
    ]
    assert index["executor"] == "local" and (tmp_path / "out" / "matrix.html").is_file()
    verify(tmp_path / "out" / "rb" / "packages" / "rtn")


@pytest.mark.slow
def test_a_merge_through_a_one_node_cluster_is_placed_and_committed(tiny, tmp_path):
    """The Ray executor at its smallest, in the default test run: one node, the merge alone (what every other stage of
    the executor goes through: the runner's run, the task's placement, the commit into the cache, the record)."""
    r = write_recipe(tmp_path / "r.yaml", tiny, tmp_path / "out", {"name": "fp8", "method": "fp8"})
    cache = tmp_path / "cache"
    with ray_cluster(1, num_cpus=1) as one:
        rc, err = finish(
            quantpipe(str(r), "--stages", "merge", "--cache", str(cache), cluster=one, tmp=tmp_path, label="merge"),
            tmp_path,
            "merge",
        )
    assert rc == 0, err[-4000:]
    rec = record(tmp_path / "out")
    merge = rec["stages"]["merge"]
    assert rec["status"] == "ok" and merge["cache"] == "miss" and set(rec["stages"]) == {"merge"}
    assert [a["node_id"] for a in merge["placement"]["attempts"]] == [one.head.node_id]
    assert set(committed(cache)) == {"merge"} and not leftovers(cache)
    assert_entries_verify(cache)


@pytest.mark.slow
@pytest.mark.long
def test_a_two_recipe_matrix_on_two_nodes_builds_every_entry_once(tiny, tmp_path, cluster):
    a = write_recipe(tmp_path / "ra.yaml", tiny, tmp_path / "out" / "ra", {"name": "fp8", "method": "fp8"})
    b = write_recipe(tmp_path / "rb.yaml", tiny, tmp_path / "out" / "rb", {"name": "rtn", "method": "rtn"})
    cache = tmp_path / "cache"
    rc, err = finish(
        quantpipe(str(a), str(b), "--cache", str(cache), cluster=cluster, tmp=tmp_path, label="matrix"),
        tmp_path,
        "matrix",
    )
    assert rc == 0, err[-4000:]
    ra, rb = record(tmp_path / "out" / "ra"), record(tmp_path / "out" / "rb")
    assert ra["status"] == rb["status"] == "ok"
    # the shared merge was built once, for one recipe; the other reused that entry
    assert sorted([ra["stages"]["merge"]["cache"], rb["stages"]["merge"]["cache"]]) == ["hit", "miss"]
    assert ra["stages"]["merge"]["key"] == rb["stages"]["merge"]["key"]
    mine = {**{f"ra/{k}": v for k, v in built(ra).items()}, **{f"rb/{k}": v for k, v in built(rb).items()}}
    assert sorted(k.split("/")[1] for k in mine) == [
        "merge",
        "package:fp8",
        "package:rtn",
        "quantize:fp8",
        "quantize:rtn",
    ]
    assert set(committed(cache)) == {"merge", "quantize:fp8", "quantize:rtn", "package:fp8", "package:rtn"}
    for (
        sid,
        st,
    ) in mine.items():  # each ran exactly once, as one Ray task, with the resources the local scheduler would grant
        p = st["placement"]
        assert len(p["attempts"]) == 1, (sid, p["attempts"])
        gpu = p["request"]["num_gpus"]
        assert (0 < gpu < 1) if "quantize" in sid else gpu == 0, (sid, p["request"])
        assert p["request"]["memory"] > 0
    nodes = {st["placement"]["attempts"][0]["node_id"] for st in mine.values()}
    assert nodes == {cluster.head.node_id, cluster.second.node_id}, "the stages did not spread over both nodes"
    for name, rec in (("ra", ra), ("rb", rb)):
        run_dir = tmp_path / "out" / name / "runs" / rec["run_id"]
        assert (run_dir / "report.html").is_file() and (run_dir / "report.json").is_file()
        for sid in built(rec):
            assert (run_dir / "logs" / f"{sid.replace(':', '_')}.log").stat().st_size > 0, sid
    verify(tmp_path / "out" / "ra" / "packages" / "fp8")
    verify(tmp_path / "out" / "rb" / "packages" / "rtn")
    index = json.loads((tmp_path / "out" / "matrix.json").read_text())
    assert [e["name"] for e in index["recipes"]] == ["ra", "rb"] and all(e["status"] == "ok" for e in index["recipes"])
    reused = {e["name"]: e["reused"] for e in index["recipes"]}
    assert {"merge"} in ({*reused["ra"]}, {*reused["rb"]})
    assert (tmp_path / "out" / "matrix.html").is_file()
    assert not leftovers(cache)
    assert_entries_verify(cache)


@pytest.mark.slow
@pytest.mark.long
def test_an_evaluation_and_its_benchmark_are_one_task_with_one_server(tiny, tmp_path, cluster):
    """Backend vllm on the cluster: each model's evaluate and benchmark stages are one Ray task, one `vllm serve` start,
    and both entries are committed on the node, each under its own key."""
    path = tmp_path / "rv.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "rv",
                "output_dir": str(tmp_path / "out"),
                "base": {"model": str(tiny.llama), "dtype": "bfloat16"},
                "artifacts": [{"name": "int8", "method": "w8a8-int8"}],
                "calibration": {"sources": [{"path": str(tiny.calibration)}], "num_samples": 16, "max_seq_len": 64},
                "evaluation": {
                    "lm_eval": {
                        "tasks": ["tiny_facts_mc"],
                        "include_path": str(tiny.tasks),
                        "limit": 16,
                        "backend": "vllm",
                    }
                },
                "benchmark": {
                    "engine": {
                        "max_model_len": 512,
                        "max_num_seqs": 8,
                        "enforce_eager": True,
                        "kv_cache_memory_bytes": 268435456,
                    },
                    "workloads": [
                        {"name": "fixed", "kind": "fixed", "input_len": 16, "output_len": 4, "num_prompts": 4}
                    ],
                    "concurrency": [1],
                },
                "package": {"enabled": False},
            }
        )
    )
    cache = tmp_path / "cache"
    rc, err = finish(
        quantpipe(str(path), "--cache", str(cache), cluster=cluster, tmp=tmp_path, label="joint"), tmp_path, "joint"
    )
    assert rc == 0, err[-4000:]
    rec = record(tmp_path / "out")
    for m in ("baseline", "int8"):
        ev, bm = rec["stages"][f"evaluate:{m}"], rec["stages"][f"benchmark:{m}"]
        assert (ev["cache"], bm["cache"], ev["status"], bm["status"]) == ("miss", "miss", "ok", "ok")
        assert ev["metrics"]["engine"]["shared"] is True and bm["metrics"]["shared_s"] > 0
        assert len(bm["placement"]["attempts"]) == 1 and bm["placement"]["request"]["num_gpus"] == 1
        server_log = (Path(bm["out"]) / "logs" / "server-default.log").read_text()
        assert len([ln for ln in server_log.splitlines() if ln.startswith("$ ") and " serve " in ln]) == 1
    assert {"evaluate:baseline", "evaluate:int8", "benchmark:baseline", "benchmark:int8"} <= set(committed(cache))
    assert not leftovers(cache)
    assert_entries_verify(cache)


@pytest.mark.slow
@pytest.mark.long
def test_a_node_without_the_environments_is_refused_by_its_address(tiny, tmp_path, cluster):
    saved = os.environ.get("QUANTPIPE_PYTHON_QUANTIZE")
    os.environ["QUANTPIPE_PYTHON_QUANTIZE"] = str(
        tmp_path / "nowhere" / "python"
    )  # this node's `ray start` has no quantize environment
    try:
        bare = cluster.cluster.add_node(**cluster.node)
    finally:
        os.environ.pop("QUANTPIPE_PYTHON_QUANTIZE") if saved is None else os.environ.__setitem__(
            "QUANTPIPE_PYTHON_QUANTIZE", saved
        )
    try:
        a = write_recipe(tmp_path / "ra.yaml", tiny, tmp_path / "out", {"name": "fp8", "method": "fp8"})
        rc, err = finish(
            quantpipe(str(a), "--cache", str(tmp_path / "cache"), cluster=cluster, tmp=tmp_path, label="refused"),
            tmp_path,
            "refused",
            timeout_s=300,
        )
        assert rc == 2, err[-3000:]
        assert f"127.0.0.1:{bare.node_manager_port}" in err and "'quantize' environment is missing" in err, err[-3000:]
        assert "Traceback" not in err
        assert not (tmp_path / "out").exists() and not (tmp_path / "cache" / "stages").exists()
    finally:
        cluster.cluster.remove_node(bare, allow_graceful=False)
        until_dead(cluster, bare.node_id)


def until_dead(cluster, node_id: str, timeout_s: float = 60) -> None:
    """Wait for the cluster's control store to count a stopped node dead (probes would wait for it otherwise)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(n["NodeID"] == node_id and n["Alive"] for n in cluster.cluster.global_state.node_table()):
            return
        time.sleep(0.5)
    pytest.fail(f"node {node_id[:8]} still counted alive {timeout_s:.0f} s after it was stopped")


def stage_workers(mark: str, stage: str, node_id: str | None = None) -> list[psutil.Process]:
    """Live worker.py processes building `stage` (their spec lies in that stage's working folder), on one node if given."""
    needle = "/stages/" + stage.replace(":", "/") + "/."
    out = []
    for p in marked(mark):
        try:
            cmd = p.cmdline()
        except psutil.Error:
            continue
        if (
            any(c.endswith("worker.py") for c in cmd)
            and needle in cmd[-1]
            and (node_id is None or f".ray-{node_id[:12]}-" in cmd[-1])
        ):
            out.append(p)
    return out


def until(what: str, cond, proc: subprocess.Popen, tmp: Path, label: str, timeout_s: float = 600):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        if proc.poll() is not None:
            pytest.fail(
                f"{label} ended (exit {proc.returncode}) before {what}:\n{(tmp / f'{label}.stderr').read_text()[-3000:]}"
            )
        time.sleep(0.05)
    pytest.fail(f"{label}: no {what} after {timeout_s:.0f} s")


@pytest.mark.slow
@pytest.mark.long
def test_a_killed_driver_then_two_drivers_on_one_cache_reuse_and_build_each_entry_once(tiny, tmp_path, cluster):
    cache = tmp_path / "cache"
    r1 = write_recipe(tmp_path / "r1.yaml", tiny, tmp_path / "out1", {"name": "fp8", "method": "fp8"}, name="shared")
    r2 = write_recipe(tmp_path / "r2.yaml", tiny, tmp_path / "out2", {"name": "fp8", "method": "fp8"}, name="shared")
    first = quantpipe(str(r1), "--cache", str(cache), cluster=cluster, tmp=tmp_path, label="killed")
    worker = until(
        "a quantize stage under way", lambda: stage_workers(cluster.mark, "quantize:fp8"), first, tmp_path, "killed"
    )[0]
    first.send_signal(signal.SIGKILL)  # kill -9 of the driver while a node builds quantize:fp8
    first.wait()
    psutil.wait_procs([worker], timeout=60)
    assert not worker.is_running(), "the stage of a killed driver is still running"
    assert "merge" in committed(cache) and "quantize:fp8" not in committed(cache)
    # two drivers at once on the same cache: every committed stage reused, each missing entry built once between them
    a = quantpipe(str(r1), "--cache", str(cache), cluster=cluster, tmp=tmp_path, label="a")
    b = quantpipe(str(r2), "--cache", str(cache), cluster=cluster, tmp=tmp_path, label="b")
    (rc_a, err_a), (rc_b, err_b) = finish(a, tmp_path, "a"), finish(b, tmp_path, "b")
    assert rc_a == 0 and rc_b == 0, (err_a[-3000:], err_b[-3000:])
    ra, rb = record(tmp_path / "out1"), record(tmp_path / "out2")
    assert ra["stages"]["merge"]["cache"] == rb["stages"]["merge"]["cache"] == "hit"
    for sid in ("quantize:fp8", "package:fp8"):
        assert sorted([ra["stages"][sid]["cache"], rb["stages"][sid]["cache"]]) == ["hit", "miss"], sid
        st = ra["stages"][sid] if ra["stages"][sid]["cache"] == "miss" else rb["stages"][sid]
        assert len(st["placement"]["attempts"]) == 1, st["placement"]
    verify(tmp_path / "out1" / "packages" / "fp8")
    verify(tmp_path / "out2" / "packages" / "fp8")
    assert not leftovers(cache)
    assert_entries_verify(cache)


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_a_signalled_driver_stops_its_stages_records_the_interrupt_and_commits_nothing_of_them(
    tiny, tmp_path, tmp_path_factory, cluster, sig
):
    cache = (
        tmp_path_factory.getbasetemp() / "signalled-cache"
    )  # one cache for both signals: the second run finds the merge committed
    r = write_recipe(tmp_path / "sig.yaml", tiny, tmp_path / "out", {"name": "fp8", "method": "fp8"})
    run = quantpipe(str(r), "--cache", str(cache), cluster=cluster, tmp=tmp_path, label="sig")
    workers = until(
        "a quantize stage under way", lambda: stage_workers(cluster.mark, "quantize:fp8"), run, tmp_path, "sig"
    )
    t0 = time.monotonic()
    run.send_signal(sig)
    rc, err = finish(run, tmp_path, "sig", timeout_s=120)
    took = time.monotonic() - t0
    assert rc == 130, err[-3000:]
    assert "interrupted: running stages were stopped" in err and "Traceback" not in err, err[-3000:]
    gone, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive, f"the stage of a {sig.name}-ed driver is still running: {alive}"
    assert not stage_workers(cluster.mark, "quantize:fp8")
    rec = record(tmp_path / "out")
    assert rec["status"] == "interrupted", rec["status"]
    assert "quantize:fp8" not in rec["stages"]  # a run records the stages that ended; the stopped one did not
    assert "merge" in committed(cache) and "quantize:fp8" not in committed(cache)
    assert not leftovers(cache)
    assert_entries_verify(cache)
    print(f"\n{sig.name}: the driver exited {took:.1f} s after the signal")


@pytest.mark.slow
@pytest.mark.long
def test_a_node_lost_mid_quantize_is_retried_elsewhere_and_the_run_ends_ok(tiny, tmp_path, cluster):
    cache = tmp_path / "cache"
    r = write_recipe(
        tmp_path / "lost.yaml",
        tiny,
        tmp_path / "out",
        {"name": "fp8", "method": "fp8"},
        {"name": "rtn", "method": "rtn"},
    )
    run = quantpipe(str(r), "--cache", str(cache), cluster=cluster, tmp=tmp_path, label="lost")
    second = cluster.second

    def on_second():
        for sid in ("quantize:fp8", "quantize:rtn"):
            if stage_workers(cluster.mark, sid, second.node_id):
                return sid
        return None

    sid = until("a quantize stage running on the second node", on_second, run, tmp_path, "lost")
    lost_workers = stage_workers(cluster.mark, sid, second.node_id)
    os.kill(second.all_processes["raylet"][0].process.pid, signal.SIGKILL)  # the node is lost mid-stage
    rc, err = finish(run, tmp_path, "lost")
    assert rc == 0, err[-4000:]
    rec = record(tmp_path / "out")
    assert rec["status"] == "ok" and all(st["status"] == "ok" for st in rec["stages"].values())
    p = rec["stages"][sid]["placement"]
    assert [a["node_id"] for a in p["attempts"]] == [second.node_id, cluster.head.node_id], p["attempts"]
    assert p["lost_s"] > 0 and "lost with node" in p["note"] and f"{p['lost_s']:g} s" in p["note"]
    assert "lost with node" in err  # said on the console too
    print(f"\n{p['note']} (lost_s {p['lost_s']})")
    assert all(not w.is_running() for w in lost_workers), "the lost attempt's stage is still running"
    assert not leftovers(cache)  # nothing of the lost attempt stayed, half-written or committed
    assert_entries_verify(cache)
    for art in ("fp8", "rtn"):
        verify(tmp_path / "out" / "packages" / art)
    cluster.cluster.remove_node(second, allow_graceful=False)
