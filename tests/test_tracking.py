"""MLflow tracking against a real tracking server the tests start (`mlflow server`, SQLite backend, 127.0.0.1, a free
port, stopped by its pid): a run's params, metrics, artifacts and registered model versions read back through
MLflow's client; a server that is down leaves the run ok and its files the record, and `history --push-mlflow`
logs what was missed, once.

    .venv/quantize/bin/python -m pytest tests/test_tracking.py -m "slow or not slow"
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_report import make_record, save_run

from quantpipe.cli import main
from quantpipe.ports import free_port
from quantpipe.report import write_report


def _health(uri: str) -> bool:
    try:
        with urllib.request.urlopen(uri + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` on 127.0.0.1 with a SQLite store and proxied artifacts; yields its URI, stops it by its pid."""
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    log = open(root / "server.log", "w")
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination",
            str(root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=root,
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300  # its first start migrates the database: a minute on a busy 2-core machine
        while not _health(uri):
            assert p.poll() is None and time.time() < deadline, (root / "server.log").read_text()[-3000:]
            time.sleep(1)
        yield uri
    finally:
        os.killpg(p.pid, signal.SIGTERM)  # the server and its uvicorn worker: the group this test started
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
        log.close()


def _client(uri):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def test_mlflow_uri_with_credentials_is_refused(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: x\noutput_dir: out\nbase: {model: org/m}\nartifacts: [{name: f, method: fp8}]\n")
    r = CliRunner().invoke(main, ["run", str(recipe), "--mlflow", "https://alice:s3cret@mlflow.example.com"])
    assert (
        r.exit_code == 2
        and "MLFLOW_TRACKING_TOKEN" in r.output
        and "s3cret" not in r.output.replace("alice:s3cret", "")
    )
    assert not (tmp_path / "out").exists()
    recipe.write_text(
        "name: x\noutput_dir: out\nbase: {model: org/m}\nartifacts: [{name: f, method: fp8}]\n"
        "tracking: {mlflow: {uri: 'http://u:p@h:5000'}}\n"
    )
    r = CliRunner().invoke(main, ["check", str(recipe)])
    assert r.exit_code == 2 and "tracking.mlflow.uri" in r.output


def test_history_push_to_a_server_that_is_down_fails_and_loses_nothing(tmp_path):
    d = save_run(tmp_path, make_record())
    write_report(make_record(), d, tmp_path)
    down = f"http://127.0.0.1:{free_port()}"
    r = CliRunner().invoke(main, ["history", str(tmp_path), "--push-mlflow", down])
    assert r.exit_code == 1 and "cannot be reached" in r.output and "nothing was lost" in r.output
    assert (tmp_path / "history.html").is_file() and not (d / "mlflow.json").exists()


# --- real runs, a real server ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_recipe_path(tiny, tmp_path_factory):
    from test_console import shared_cache, tiny_recipe

    tmp = tmp_path_factory.mktemp("tracked")
    return tiny_recipe(
        tmp / "r.yaml",
        tiny,
        shared_cache(tmp_path_factory),
        tmp / "out",
        tracking={"mlflow": {"uri": "http://127.0.0.1:1", "experiment": "quantpipe-tests"}},
    )


def _runs(recipe: Path) -> list[dict]:
    """runs/index.jsonl of the recipe's output directory (tiny_recipe puts it beside the recipe)."""
    return [json.loads(line) for line in (recipe.parent / "out" / "runs" / "index.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_run_logs_to_mlflow_and_registers_each_package(mlflow_server, tiny_recipe_path):
    r = CliRunner().invoke(main, ["run", str(tiny_recipe_path), "--mlflow", mlflow_server])
    assert r.exit_code == 0, r.output
    assert "MLflow: logged run" in r.output and "(experiment quantpipe-tests, 2 model version(s))" in r.output
    run = _runs(tiny_recipe_path)[-1]
    run_dir = Path(run["run_dir"])
    record = json.loads((run_dir / "run.json").read_text())
    report = json.loads((run_dir / "report.json").read_text())
    marker = json.loads((run_dir / "mlflow.json").read_text())["servers"][0]
    client = _client(mlflow_server)
    exp = client.get_experiment_by_name("quantpipe-tests")
    found = client.search_runs([exp.experiment_id], f"tags.`quantpipe.run_id` = '{run['run_id']}'")
    assert [x.info.run_id for x in found] == [marker["mlflow_run_id"]] and found[0].info.status == "FINISHED"
    m = found[0]
    assert (
        m.data.params["recipe_hash"] == record["recipe_hash"]
        and m.data.params["versions.quantize.torch"] == record["versions"]["quantize"]["torch"]
    )
    assert m.data.params["hardware"] == report["provenance"]["hardware_text"]
    rows = {x["artifact"]: x for x in report["rows"]}
    assert m.data.metrics["fp8/recovery"] == pytest.approx(rows["fp8"]["recovery"])
    assert m.data.metrics["rtn/kl_mean"] == pytest.approx(rows["rtn"]["kl_mean"])
    assert m.data.metrics["rtn/size_bytes"] == rows["rtn"]["size_bytes"] and m.data.metrics["fp8/gate_pass"] == 1.0
    assert m.data.metrics["stages/quantize.rtn/wall_s"] == pytest.approx(record["stages"]["quantize:rtn"]["wall_s"])
    files = {a.path for a in client.list_artifacts(m.info.run_id)} | {
        a.path for a in client.list_artifacts(m.info.run_id, "packages/fp8")
    }
    assert {"report.html", "report.json", "run.json", "packages/fp8/manifest.json", "packages/fp8/README.md"} <= files
    versions = {
        v.tags["artifact"]: v
        for v in client.search_model_versions(f"name = '{record['recipe_name']}'")
        if v.tags.get("quantpipe.run_id") == run["run_id"]
    }
    assert set(versions) == {"fp8", "rtn"}
    choice = report["recommendation"]["choice"]
    for name, v in versions.items():
        assert v.tags["gate"] == rows[name]["gate"] == "PASS" and v.tags["recommended"] == str(name == choice).lower()
        assert v.tags["package_path"] == rows[name]["package"] and v.run_id == m.info.run_id
    assert client.get_model_version_by_alias(record["recipe_name"], "recommended").version == versions[choice].version


@pytest.mark.slow
def test_a_run_while_the_server_is_down_succeeds_and_is_pushed_later(mlflow_server, tiny_recipe_path):
    # the recipe's tracking.mlflow.uri points at a closed port: the run is ok, says so, and its files are whole
    r = CliRunner().invoke(main, ["run", str(tiny_recipe_path)])
    assert r.exit_code == 0, r.output
    assert (
        "MLflow: not logged: MLflow at http://127.0.0.1:1 cannot be reached" in r.output
        and "--push-mlflow http://127.0.0.1:1" in r.output
    )
    missed = _runs(tiny_recipe_path)[-1]
    run_dir = Path(missed["run_dir"])
    assert not (run_dir / "mlflow.json").exists() and (run_dir / "report.html").is_file()
    assert json.loads((run_dir / "run.json").read_text())["status"] == "ok"
    # the server is back (here: the real one): the push logs exactly what it missed, then nothing more
    out = tiny_recipe_path.parent / "out"
    r = CliRunner().invoke(main, ["history", str(out), "--push-mlflow", mlflow_server])
    assert r.exit_code == 0, r.output
    assert missed["run_id"] in r.output.split("logged", 1)[1].splitlines()[0]
    client = _client(mlflow_server)
    exp = client.get_experiment_by_name("quantpipe-tests")
    found = client.search_runs([exp.experiment_id], f"tags.`quantpipe.run_id` = '{missed['run_id']}'")
    assert len(found) == 1 and "fp8/recovery" in found[0].data.metrics
    r = CliRunner().invoke(main, ["history", str(out), "--push-mlflow", mlflow_server])
    assert r.exit_code == 0 and "logged 0 run(s)" in r.output
    assert len(client.search_runs([exp.experiment_id], f"tags.`quantpipe.run_id` = '{missed['run_id']}'")) == 1
    # a marker lost after a push: the next push finds the run by its tag instead of logging it twice
    (run_dir / "mlflow.json").unlink()
    r = CliRunner().invoke(main, ["history", str(out), "--push-mlflow", mlflow_server])
    assert r.exit_code == 0, r.output
    assert len(client.search_runs([exp.experiment_id], f"tags.`quantpipe.run_id` = '{missed['run_id']}'")) == 1
    assert (run_dir / "mlflow.json").is_file()
