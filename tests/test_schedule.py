"""The scheduler's rules on simulated GPUs: benchmarks alone on their GPU, quantize/evaluate packed by estimate."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from quantpipe.common import measure_gate
from quantpipe.run.schedule import GIB, Gpu, Scheduler, default_jobs, gpus


def two_gpus(gib: int = 80) -> list[Gpu]:
    return [Gpu("0", gib * GIB), Gpu("1", gib * GIB)]


def est(gpu_gib: float, ram_gib: float = 1) -> dict:
    return {"gpu_bytes": int(gpu_gib * GIB), "ram_bytes": int(ram_gib * GIB)}


def test_quantize_stages_pack_on_the_busiest_gpu_they_fit():
    s = Scheduler(two_gpus(), jobs=8)
    grants = [s.try_start(f"quantize:{i}", "quantize", est(30)) for i in range(4)]
    assert all(grants)
    # 30 GiB each: two fill GPU 0 as far as they fit (80 GiB), the next go to GPU 1
    assert [g.gpus[0] for g in grants] == ["0", "0", "1", "1"]
    assert s.try_start("quantize:4", "quantize", est(30)) is None  # 60 of 80 GiB used on each: 30 more do not fit


def test_shared_stages_leave_an_idle_gpu_for_a_benchmark():
    s = Scheduler(two_gpus(), jobs=8)
    for i in range(3):
        assert s.try_start(f"quantize:{i}", "quantize", est(5)).gpus == ["0"]  # packed: GPU 1 stays idle
    b = s.try_start("benchmark:baseline", "benchmark", est(0))
    assert b is not None and b.gpus == ["1"] and b.exclusive


def test_benchmark_gets_a_gpu_to_itself_and_nothing_joins_it():
    s = Scheduler(two_gpus(), jobs=8)
    q = s.try_start("quantize:a", "quantize", est(5))
    b = s.try_start("benchmark:baseline", "benchmark", est(0))
    assert b is not None and b.exclusive and b.gpus != q.gpus
    assert s.try_start("quantize:b", "quantize", est(5)).gpus == q.gpus  # never onto the benchmark's GPU
    assert s.try_start("benchmark:a", "benchmark", est(0)) is None  # both GPUs busy


def test_a_benchmark_waits_for_an_idle_gpu_and_then_has_it_alone():
    s = Scheduler([Gpu("0", 80 * GIB)], jobs=8)
    assert s.try_start("quantize:a", "quantize", est(5)) is not None
    assert s.try_start("benchmark:a", "benchmark", est(0)) is None  # the only GPU is in use
    s.finish("quantize:a")
    assert s.try_start("benchmark:a", "benchmark", est(0)).gpus == ["0"]
    assert s.try_start("quantize:b", "quantize", est(5)) is None  # nothing joins a benchmark's GPU


def test_without_gpus_a_benchmark_runs_alone():
    s = Scheduler([], jobs=4)
    assert s.try_start("merge", "merge", est(0)) is not None
    assert s.try_start("benchmark:baseline", "benchmark", est(0)) is None
    s.finish("merge")
    assert s.try_start("benchmark:baseline", "benchmark", est(0)) is not None
    assert s.try_start("package:a", "package", est(0)) is None


def test_jobs_and_ram_cap_concurrency_but_one_stage_always_starts():
    s = Scheduler(two_gpus(), ram_bytes=10 * GIB, jobs=2)
    assert s.try_start("merge", "merge", est(0, ram_gib=50)) is not None  # alone, whatever its estimate
    assert s.try_start("quantize:a", "quantize", est(1, ram_gib=1)) is None  # over the RAM budget beside it
    s.finish("merge")
    assert s.try_start("quantize:a", "quantize", est(1, 4)) and s.try_start("quantize:b", "quantize", est(1, 4))
    assert s.try_start("quantize:c", "quantize", est(1, 1)) is None  # jobs=2
    assert default_jobs(0) == 1 and default_jobs(2) == 8


def test_a_shared_benchmark_starts_beside_other_work_and_measures_only_when_the_gpu_is_idle():
    s = Scheduler([Gpu("0", 80 * GIB)], jobs=8)
    assert s.try_start("quantize:a", "quantize", est(10)) is not None
    b = s.try_start("benchmark:baseline", "benchmark", est(20), share=True)
    assert b is not None and not b.exclusive and b.gpus == ["0"]  # beside the quantize stage
    c = s.try_start("benchmark:x", "benchmark", est(20), share=True)
    assert c is not None and c.gpus == ["0"]
    assert s.try_start("benchmark:y", "benchmark", est(40), share=True) is None  # 10 + 20 + 20 + 40 > 80 GiB
    s.wait_to_measure("benchmark:baseline")
    assert not s.try_measure("benchmark:baseline")  # quantize:a and benchmark:x still work on the GPU
    assert s.blockers("benchmark:baseline") == ["benchmark:x", "quantize:a"]
    assert s.try_start("quantize:c", "quantize", est(1)) is None  # nothing joins a GPU whose benchmark waits to measure
    s.finish("quantize:a")
    s.wait_to_measure("benchmark:x")  # idle: waiting for its own turn
    assert s.try_measure("benchmark:baseline")
    assert not s.try_measure("benchmark:x")  # one measurement at a time
    assert s.try_start("quantize:b", "quantize", est(1)) is None  # nothing starts on a GPU that is measured
    s.end_measure("benchmark:baseline")  # busy again (its server stops, or the next variant's starts)
    assert not s.try_measure("benchmark:x")
    s.finish("benchmark:baseline")
    assert s.try_measure("benchmark:x")
    s.end_measure("benchmark:x")
    assert s.try_start("quantize:b", "quantize", est(1)) is not None


def test_shared_benchmarks_measure_in_the_order_they_asked():
    """The baseline asks while another benchmark's server still starts; when that one asks too, the GPU is idle and the
    baseline, which asked first, measures first, whichever of the two the runner looks at first."""
    s = Scheduler([Gpu("0", 80 * GIB)], jobs=8)
    for sid in ("benchmark:baseline", "benchmark:awq", "benchmark:gptq"):
        assert s.try_start(sid, "benchmark", est(10), share=True) is not None
    s.wait_to_measure("benchmark:baseline")
    assert not s.try_measure("benchmark:baseline")  # awq and gptq still start their servers
    s.wait_to_measure("benchmark:awq")
    s.wait_to_measure("benchmark:gptq")
    assert not s.try_measure("benchmark:gptq") and not s.try_measure("benchmark:awq")  # the baseline asked first
    assert s.blockers("benchmark:gptq") == ["benchmark:awq", "benchmark:baseline"]  # what the console names
    s.wait_to_measure("benchmark:baseline")  # asking again keeps its place
    assert s.try_measure("benchmark:baseline")
    s.finish("benchmark:baseline")
    assert not s.try_measure("benchmark:gptq") and s.try_measure("benchmark:awq")


def test_a_shared_benchmark_takes_the_idlest_gpu_and_a_benchmark_that_cannot_share_stays_alone():
    s = Scheduler(two_gpus(), jobs=8)
    s.try_start("quantize:a", "quantize", est(5))
    assert s.try_start("benchmark:a", "benchmark", est(20), share=True).gpus == ["1"]
    assert s.try_start("benchmark:b", "benchmark", est(20)) is None  # exclusive: no GPU is idle
    assert s.try_start("benchmark:c", "benchmark", est(20), n_gpus=2, share=True) is None  # tensor-parallel: whole GPUs


def test_on_a_host_without_gpus_and_several_jobs_a_shared_benchmark_shares_the_host_and_measures_alone():
    s = Scheduler([], jobs=2)
    e = s.try_start("evaluate:baseline", "evaluate", est(0))
    assert e is not None and e.cpu_shared  # its OpenMP threads sleep, not spin, while they wait
    b = s.try_start("benchmark:baseline", "benchmark", est(0), share=True)
    assert b is not None and not b.exclusive and b.gpus == []  # beside the evaluation, no GPU named
    assert not b.cpu_shared  # what it measures it measures alone, as vLLM sets its threads
    s.wait_to_measure("benchmark:baseline")
    assert s.blockers("benchmark:baseline") == ["evaluate:baseline"]
    s.finish("evaluate:baseline")
    assert s.try_start("quantize:a", "quantize", est(0)) is None  # the slot is free, but the benchmark waits to measure
    assert s.try_measure("benchmark:baseline")
    assert s.try_start("package:a", "package", est(0)) is None  # nothing starts while it measures
    s.end_measure("benchmark:baseline")
    assert s.try_start("quantize:a", "quantize", est(0)) is not None
    one = Scheduler([], jobs=1)  # one stage at a time: a benchmark is alone anyway, and measures without asking
    assert one.try_start("benchmark:baseline", "benchmark", est(0), share=True).exclusive


def test_measure_gate_protocol_between_stage_and_runner(tmp_path, monkeypatch):
    """The stage asks (want-N), waits for go-N, says done-N; without the variable it never waits."""
    import threading

    from quantpipe.common import measure_gate

    with measure_gate.measuring() as g:
        assert g == {"shared_gpu": False, "waited_s": 0.0}
    monkeypatch.setenv(measure_gate.ENV, str(tmp_path))
    seen = []

    def stage():
        with measure_gate.measuring(poll_s=0.01) as g:
            seen.append(g)

    t = threading.Thread(target=stage)
    t.start()
    for _ in range(500):
        n, state = measure_gate.latest(tmp_path)
        if state == "want":
            break
        threading.Event().wait(0.01)
    assert state == "want" and not seen  # waiting for the runner
    measure_gate.grant(tmp_path, n)
    t.join(5)
    assert seen and seen[0]["shared_gpu"] and measure_gate.latest(tmp_path) == (n, "done")


def test_simulated_gpus_and_gpu_selection(monkeypatch):
    monkeypatch.setenv("QUANTPIPE_GPUS", "2x24")
    assert [(g.index, g.total_bytes) for g in gpus()] == [("0", 24 * GIB), ("1", 24 * GIB)]
    assert [g.index for g in gpus("1")] == ["1"]
    with pytest.raises(ValueError, match="--gpus: no GPU 3 on this host"):
        gpus("3")


def test_visible_gpus_follow_cuda_visible_devices_and_gpu_memory_is_none_when_it_hides_every_gpu(monkeypatch, tmp_path):
    """CUDA_VISIBLE_DEVICES unset: None (every GPU visible); set: its stripped entries but those starting with "-", so
    "" and "-1" leave []. With every GPU hidden pre-flight reads no GPU memory, though nvidia-smi (a stand-in) lists one."""
    from quantpipe import preflight
    from quantpipe.common.nvidia import visible_gpus

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpus() is None
    for value, expected in [("0,1", ["0", "1"]), ("", []), ("-1", []), (" 1 , -1", ["1"])]:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
        assert visible_gpus() == expected, value
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text('#!/bin/sh\necho "81920, 81000"\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}:/usr/bin:/bin")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert preflight.gpu_memory() == {
        "total_bytes": 81920 * 2**20,
        "free_bytes": 81000 * 2**20,
        "card_bytes": 81920 * 2**20,
        "name": "",
    }
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert preflight.gpu_memory() is None


# --- real stages on the tiny model, two simulated GPUs ------------------------------------------------


@pytest.mark.slow
@pytest.mark.long
def test_one_run_uses_both_simulated_gpus_and_keeps_benchmarks_alone(tiny, tmp_path):
    """The tiny recipe (merge, two artifacts, evaluation, three benchmarks, packages) run with QUANTPIPE_GPUS=2 and
    --jobs 4 as a user runs it: every stage ok, each started after what it reads, stages shared a GPU at once,
    nothing shared a benchmark's GPU while it ran, and the report draws the timeline."""
    import json
    import os
    import subprocess
    import sys

    import yaml

    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "name": "sched",
                "output_dir": str(tmp_path / "out"),
                "cache_dir": str(tmp_path / "cache"),
                "base": {"model": str(tiny.llama)},
                "adapters": [{"path": str(tiny.llama_lora)}],
                "artifacts": [{"name": "fp8", "method": "fp8"}, {"name": "rtn", "method": "rtn", "group_size": 128}],
                "evaluation": {"validation": {"path": str(tiny.validation), "max_new_tokens": 8}},
                "benchmark": {
                    "workloads": [{"name": "fixed", "input_len": 32, "output_len": 8, "num_prompts": 4}],
                    "concurrency": [1],
                    "offline": False,
                    "lora": False,
                    "engine": {"enforce_eager": True},
                },
            }
        )
    )
    env = {**os.environ, "QUANTPIPE_GPUS": "2"}
    res = subprocess.run(
        [sys.executable, "-m", "quantpipe", "run", str(recipe), "--jobs", "4"],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    assert res.returncode in (0, 3), res.stderr[-4000:]
    run_dir = next((tmp_path / "out" / "runs").glob("*/run.json")).parent
    rec = json.loads((run_dir / "run.json").read_text())
    stages = rec["stages"]
    assert all(s["status"] == "ok" for s in stages.values()), {
        k: s.get("error") for k, s in stages.items() if s["status"] != "ok"
    }
    assert rec["scheduler"] == {"gpus": ["0", "1"], "jobs": 4, "gpu_memory_gib": None}
    deps = {"quantize": ["merge"], "evaluate": ["merge"], "benchmark": ["merge"], "package": ["merge"]}
    for sid, s in stages.items():
        kind, _, art = sid.partition(":")
        need = list(deps.get(kind, []))
        if art and art != "baseline" and kind != "quantize":
            need.append(f"quantize:{art}")
        if kind == "evaluate" and art != "baseline":
            need.append("evaluate:baseline")
        for d in need:
            assert stages[d]["end_s"] <= s["start_s"] + 1e-3, f"{sid} started before {d} ended"
    overlap = lambda a, b: a["start_s"] < b["end_s"] and b["start_s"] < a["end_s"]  # noqa: E731
    shared = [
        (a, b)
        for a in stages
        for b in stages
        if a < b and set(stages[a]["devices"]) & set(stages[b]["devices"]) and overlap(stages[a], stages[b])
    ]
    assert shared, "no two stages ever shared a GPU at once"
    for sid, s in stages.items():
        if sid.startswith("benchmark:"):
            assert s["devices"], sid
            others = [
                o
                for o in stages
                if o != sid and set(stages[o]["devices"]) & set(s["devices"]) and overlap(stages[o], s)
            ]
            assert not others, f"{sid} shared its GPU with {others}"
    assert (run_dir / "plots" / "timeline.png").is_file()


@pytest.mark.slow
@pytest.mark.long
def test_shared_benchmarks_measure_only_while_nothing_else_works_on_their_device(tiny, tmp_path):
    """The tiny recipe with kv_cache_memory_bytes set, on this host without GPUs and two jobs (the host shared like
    one GPU): the benchmarks start beside the other stages, and every measured stretch (as the runner granted it)
    overlaps no other stage's work."""
    import json
    import os
    import subprocess
    import sys

    import yaml

    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "name": "shared",
                "output_dir": str(tmp_path / "out"),
                "cache_dir": str(tmp_path / "cache"),
                "base": {"model": str(tiny.llama)},
                "artifacts": [{"name": "int8", "method": "w8a8-int8"}],  # servable on any x86 CPU
                "calibration": {
                    "sources": [{"path": str(Path(__file__).parents[1] / "calibration" / "tiny-mix.jsonl")}],
                    "num_samples": 16,
                    "max_seq_len": 64,
                },
                "evaluation": {"validation": {"path": str(tiny.validation), "max_new_tokens": 8}},
                "benchmark": {
                    "workloads": [{"name": "fixed", "input_len": 32, "output_len": 8, "num_prompts": 4}],
                    "concurrency": [1],
                    "offline": False,
                    "lora": False,
                    "engine": {"enforce_eager": True, "kv_cache_memory_bytes": 256 << 20},
                },
            }
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "QUANTPIPE_GPUS"}
    res = subprocess.run(
        [sys.executable, "-m", "quantpipe", "run", "--jobs", "2", str(recipe)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    assert res.returncode in (0, 3), res.stderr[-4000:]
    rec = json.loads(next((tmp_path / "out" / "runs").glob("*/run.json")).read_text())
    stages = rec["stages"]
    assert all(s["status"] == "ok" for s in stages.values()), {
        k: s.get("error") for k, s in stages.items() if s["status"] != "ok"
    }
    benches = {sid: s for sid, s in stages.items() if sid.startswith("benchmark:")}
    overlap = lambda a0, a1, b0, b1: a0 < b1 - 0.6 and b0 < a1 - 0.6  # noqa: E731  (the runner looks every 0.5 s)
    busy = {}  # stage -> the stretches it worked on the GPU
    for sid, s in stages.items():
        if sid in benches:
            w = s["measured_s"]
            assert len(w) == 1 and w[0][0] < w[0][1], (sid, w)
            asked = w[0][0] - s["metrics"]["variants"]["default"]["gate"]["waited_s"]
            busy[sid] = [(s["start_s"], asked), (w[0][1], s["end_s"])]
            assert "started beside other work" in " ".join(s["metrics"]["engine_notes"])
        else:
            busy[sid] = [(s["start_s"], s["end_s"])]
    shared = [
        (b, o)
        for b in benches
        for o in busy
        if o != b and overlap(benches[b]["start_s"], benches[b]["end_s"], *busy[o][0])
    ]
    assert shared, "no benchmark ever started beside another stage"
    for b, s in benches.items():
        m0, m1 = s["measured_s"][0]
        hits = [o for o in busy if o != b for (t0, t1) in busy[o] if overlap(m0, m1, t0, t1)]
        hits += [o for o in benches if o != b if overlap(m0, m1, *benches[o]["measured_s"][0])]
        assert not hits, f"{b} measured while {hits} worked on its device"
    assert "waits for the host to itself to measure" in res.stdout + res.stderr


def test_the_measure_gates_of_dead_runners_are_swept_and_a_live_ones_kept(tmp_path):
    """A runner killed while a shared benchmark measured leaves its gate folder in <cache>/tmp; the next run's sweep
    removes it, and keeps the folder of a runner that is alive."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    gone = tmp_path / f"{measure_gate.PREFIX}{dead.pid}-ab12"
    gone.mkdir()
    (gone / "want-1").touch()
    kept = Path(measure_gate.new_folder(tmp_path))
    (kept / "want-1").touch()
    measure_gate.sweep(tmp_path)
    assert not gone.exists() and (kept / "want-1").exists()
    assert kept.name.startswith(f"{measure_gate.PREFIX}{os.getpid()}-")


def test_the_stage_timeout_leaves_out_a_benchmarks_wait_for_its_turn(tmp_path):
    """A stage of 3 s that waits for its turn at the measure gate for its first 2.5 s is within a 2 s limit; the same
    stage counted in full is stopped at 2 s."""
    import time

    from quantpipe.run.process import Processes

    procs = Processes(tmp_path, [])
    t0 = time.monotonic()
    assert procs.spawn(["sleep", "3"], tmp_path / "waits.log", 2.0, paused=lambda: time.monotonic() - t0 < 2.5) == 0
    t0 = time.monotonic()
    assert procs.spawn(["sleep", "3"], tmp_path / "counted.log", 2.0) is None
    assert time.monotonic() - t0 < 2.9


def test_a_stage_that_shares_a_gpu_waits_until_its_memory_is_really_free():
    """Grants alone would let a 30 GiB server start beside a 40 GiB one on an 80 GiB card; when nvidia-smi says only
    20 GiB are free (other processes, or a server above its estimate) it waits, and starts once that much is free."""
    free = {"0": 20 * GIB}
    s = Scheduler([Gpu("0", 80 * GIB)], jobs=4, free_probe=lambda g: free[g.index])
    assert s.try_start("benchmark:a", "benchmark", {"gpu_bytes": 40 * GIB}, share=True) is not None
    assert s.try_start("benchmark:b", "benchmark", {"gpu_bytes": 30 * GIB}, share=True) is None
    free["0"] = 31 * GIB
    g = s.try_start("benchmark:b", "benchmark", {"gpu_bytes": 30 * GIB}, share=True)
    assert g is not None and g.gpu_bytes == 30 * GIB
    # the first stage on an idle GPU starts whatever the probe says (pre-flight checked the free memory at the start)
    s2 = Scheduler([Gpu("0", 80 * GIB)], jobs=4, free_probe=lambda g: 0)
    assert s2.try_start("quantize:x", "quantize", {"gpu_bytes": 4 * GIB}) is not None


def test_gpu_memory_caps_what_a_run_uses_of_each_card(monkeypatch, tmp_path):
    """--gpu-memory 40GiB on an 80 GiB card: the scheduler's GPU and pre-flight see 40 GiB, and the free memory less the
    40 GiB left to others. (nvidia-smi is outside the product and absent on CI: a script stands in for it.)"""
    from quantpipe import preflight
    from quantpipe.run.schedule import free_bytes

    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(
        '#!/bin/sh\ncase "$*" in *index,memory.total*) echo "0, 81920, NVIDIA H100 80GB HBM3";; '
        '*memory.total,memory.free*) echo "81920, 71680, NVIDIA H100 80GB HBM3";; *) echo "71680";; esac\n'
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}:/usr/bin:/bin")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("QUANTPIPE_GPUS", raising=False)
    (g,) = gpus(cap_bytes=40 * GIB)
    assert (g.total_bytes, g.card_bytes, g.name) == (40 * GIB, 80 * GIB, "NVIDIA H100 80GB HBM3")
    assert free_bytes(g) == 30 * GIB  # 70 GiB free on the card, of which 40 GiB are not this run's
    assert gpus()[0].total_bytes == 80 * GIB
    mem = preflight.gpu_memory(40 * GIB)
    assert (mem["total_bytes"], mem["free_bytes"], mem["card_bytes"]) == (40 * GIB, 30 * GIB, 80 * GIB)
