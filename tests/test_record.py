"""The run record's models: what the runner writes reads back unchanged, and a damaged part reads as missing."""

import json

from quantpipe.report.records import BenchmarkFigures, EvaluateFigures
from quantpipe.run.record import ArtifactRecord, RunRecord, StageRecord, close_dead_runs, write_record


def _written(tmp_path) -> RunRecord:
    rec = RunRecord(run_id="r1", recipe={"name": "x", "artifacts": [{"name": "int8", "method": "w8a8-int8"}]})
    rec.status = "running"
    rec.stages["merge"] = StageRecord(
        kind="merge", artifact=None, env="quantize", key="k", status="skipped", reason="r"
    )
    ok = StageRecord(kind="quantize", artifact="int8", env="quantize", key="k2", cache="miss", status="ok", wall_s=2)
    rec.stages["quantize:int8"] = ok.model_copy(
        update={"metrics": {"size_bytes": 10}, "devices": ["0"], "start_s": 1.5}
    )
    rec.artifacts["int8"] = ArtifactRecord(method="w8a8-int8", stages={"quantize:int8": "ok"}, gate="PASS")
    (tmp_path / "runs" / "r1").mkdir(parents=True)
    write_record(tmp_path / "runs" / "r1", rec, [])
    return rec


def test_a_record_reads_back_as_the_runner_wrote_it(tmp_path):
    rec = _written(tmp_path)
    on_disk = json.loads((tmp_path / "runs" / "r1" / "run.json").read_text())
    # only what was set is written: a skipped stage has no wall time, metrics or devices
    assert on_disk["stages"]["merge"] == {
        "kind": "merge",
        "artifact": None,
        "env": "quantize",
        "key": "k",
        "status": "skipped",
        "reason": "r",
    }
    assert on_disk["stages"]["quantize:int8"]["wall_s"] == 2 and isinstance(
        on_disk["stages"]["quantize:int8"]["wall_s"], int
    )
    back = RunRecord.read(tmp_path / "runs" / "r1" / "run.json")
    assert back.to_json() == on_disk == rec.to_json()
    assert back.metrics("quantize:int8") == {"size_bytes": 10} and back.metrics("merge") == {}


def test_a_run_that_died_running_is_closed_as_killed(tmp_path):
    _written(tmp_path)
    (tmp_path / "runs" / "r2").mkdir()
    close_dead_runs(tmp_path, tmp_path / "runs" / "r2", [])
    back = RunRecord.read(tmp_path / "runs" / "r1" / "run.json")
    assert back.status == "killed" and "found by run r2" in back.error
    assert back.stages["quantize:int8"].devices == ["0"]  # the rest of the record kept
    assert json.loads((tmp_path / "runs" / "index.jsonl").read_text())["status"] == "killed"


def test_damaged_parts_read_as_missing_and_good_ones_keep_their_type():
    rec = RunRecord.of(
        {
            "hardware": "x",
            "stages": {
                "a": "not a stage",
                "benchmark:b": {
                    "status": "ok",
                    "wall_s": float("nan"),
                    "devices": "0",
                    "metrics": {
                        "results": [3, {"concurrency": "4", "goodput": 1.5, "ttft_ms": []}, {"concurrency": 8}],
                        "best": None,
                    },
                },
                "evaluate:b": {"status": "ok", "metrics": {"comparison": {"task": "x"}, "fidelity": {"kl_mean": True}}},
            },
        }
    )
    assert list(rec.stages) == ["benchmark:b", "evaluate:b"] and rec.hardware.gpus == []
    st = rec.stage("benchmark:b")
    assert st.wall_s is None and st.devices == [] and rec.stage("missing").status is None
    bench = BenchmarkFigures.of(rec, "benchmark:b")
    assert [(r.concurrency, r.goodput) for r in bench.results] == [(None, 1.5), (8, None)]
    assert bench.results[0].ttft_ms.p99 is None and bench.best.variant is None and bench.best_row() is None
    ev = EvaluateFigures.of(rec, "evaluate:b")
    assert ev.comparison == [] and ev.fidelity.kl_mean is None


def test_every_recorded_run_reads_back_field_for_field():
    """The runs kept under docs/records (CPU and GPU hosts, every stage kind) read back and dump to the same JSON:
    no field the runner writes is dropped or retyped by the models."""
    from pathlib import Path

    found = sorted((Path(__file__).parent.parent / "docs" / "records").rglob("run*.json"))
    runs = [json.loads(f.read_text()) for f in found]
    runs = [r for r in runs if isinstance(r, dict) and "stages" in r]
    assert len(runs) >= 3
    for r in runs:
        assert json.dumps(RunRecord.of(r).to_json(), sort_keys=True) == json.dumps(r, sort_keys=True)


def test_compare_and_history_take_the_same_json_for_a_run_record(tmp_path):
    """One rule (`RunRecord.is_record`): `quantpipe compare` refuses what history skips, and takes what history shows."""
    import pytest

    from quantpipe.history import load_runs
    from quantpipe.report.records import CompareError
    from quantpipe.report.run_lookup import load_run

    _written(tmp_path)
    (tmp_path / "runs" / "r1" / "run.json").write_text(
        json.dumps(json.loads((tmp_path / "runs" / "r1" / "run.json").read_text()) | {"status": "ok"})
    )
    for i, raw in enumerate(({"run_id": "a"}, {"run_id": "b", "stages": []}, ["stages"])):
        d = tmp_path / "runs" / f"z{i}"
        d.mkdir()
        (d / "run.json").write_text(json.dumps(raw))
        with pytest.raises(CompareError, match="not a quantpipe run record"):
            load_run(d)
    (tmp_path / "recipe.yaml").write_text("name: x\n")
    with pytest.raises(CompareError, match=r"not JSON .*give a run directory"):
        load_run(tmp_path / "recipe.yaml")
    assert [rec.run_id for rec, _ in load_runs(tmp_path)] == ["r1"]
    assert load_run(tmp_path / "runs" / "r1")[0].run_id == "r1"
