"""Logging runs to an MLflow tracking server, where a team already runs one. The run's own files stay the record.

A finished run becomes an MLflow run named by quantpipe's run id (params, metrics per artifact and stage, the reports and
each package's card and manifest), and each package a version of the registered model named after the recipe, tagged with
its gate verdict (the recommended one also gets the alias `recommended`). `mlflow.json` in the run folder records where
the run was logged, so `--push-mlflow` logs exactly the runs a server that was down missed; an unreachable server is an
`MlflowUnavailable`, which the CLI reports without failing the run.

    quantpipe run recipes/demo.yaml --mlflow http://127.0.0.1:5000
    quantpipe history out/demo --push-mlflow http://127.0.0.1:5000
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from .run.record import RUN_DONE, RunRecord

MARKER = "mlflow.json"
PACKAGE_FILES = ("manifest.json", "README.md", "config.json", "generation_config.json", "recipe.yaml")
FIGURES = (
    "recovery",
    "kl_mean",
    "top1_agreement",
    "goodput",
    "throughput_tok_s",
    "latency_s_batch1",
    "size_bytes",
    "compression",
)


class MlflowUnavailable(Exception):
    """The tracking server could not be reached or refused the run; the message says which and what to do."""


def reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Raise MlflowUnavailable unless an http(s) tracking server answers /health (other URIs are checked by MLflow itself)."""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s) as r:
            if r.status == 200:
                return
            raise MlflowUnavailable(f"MLflow at {uri} answered /health with HTTP {r.status}")
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise MlflowUnavailable(f"MLflow at {uri} cannot be reached ({getattr(e, 'reason', None) or e})") from None


def _client(uri: str):
    os.environ.setdefault(
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2"
    )  # a server that is down should not hold the run for minutes
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def logged(run_dir: Path, uri: str) -> dict | None:
    """What mlflow.json says was logged of this run to `uri`, or None."""
    try:
        data = json.loads((Path(run_dir) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return next((x for x in data.get("servers", []) if isinstance(x, dict) and x.get("uri") == uri), None)


def log_run(run_dir: Path, uri: str, experiment: str | None = None) -> dict:
    """Log the finished run in run_dir to the tracking server at `uri`; return what was logged (also in mlflow.json)."""
    from .report.summary import summarize

    run_dir = Path(run_dir)
    record = RunRecord.read(run_dir / "run.json")
    experiment = experiment or _recipe_experiment(record) or record.recipe_name or "quantpipe"
    reachable(uri)
    try:
        return _log(run_dir, record, summarize(record), uri, experiment)
    except MlflowUnavailable:
        raise
    except Exception as e:  # the server went away mid-way, or refused a call: the next push logs the run again
        raise MlflowUnavailable(
            f"MLflow at {uri} did not take run {record.run_id} ({type(e).__name__}: {str(e)[:300]})"
        ) from None


def _log(run_dir: Path, record: RunRecord, s: dict, uri: str, experiment: str) -> dict:
    from mlflow.entities import Metric, Param, RunTag

    client = _client(uri)
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(experiment)
    qp_run = str(record.run_id)
    for old in client.search_runs([exp_id], f"tags.`quantpipe.run_id` = '{qp_run}'"):
        if old.info.status == "FINISHED":  # logged before, its marker lost: reuse it, log nothing twice
            done = {
                "uri": uri,
                "experiment": experiment,
                "experiment_id": exp_id,
                "mlflow_run_id": old.info.run_id,
                "models": json.loads(old.data.tags.get("quantpipe.models", "[]")),
                "logged_at": old.data.tags.get("quantpipe.logged_at"),
            }
            _mark(run_dir, done)
            return done
        client.delete_run(old.info.run_id)  # a push cut short: start it again
    rec = s["recommendation"]
    tags = {
        "mlflow.runName": qp_run,
        "quantpipe.run_id": qp_run,
        "quantpipe.status": str(record.status),
        "quantpipe.recipe_name": str(record.recipe_name),
        "quantpipe.recommended": str(rec.get("choice") or ""),
        "quantpipe.run_dir": str(run_dir.resolve()),
        "mlflow.note.content": rec.get("sentence") or "",
    }
    run = client.create_run(exp_id, start_time=_ms(record.started_at), tags=tags)
    rid = run.info.run_id
    ts = _ms(record.finished_at) or int(time.time() * 1000)
    params = _params(record, s)
    metrics = [Metric(k, float(v), ts, 0) for k, v in _metrics(record, s).items()]
    for i in range(
        0, max(len(metrics), len(params)), 100
    ):  # log_batch takes at most 1000 metrics and 100 params a call
        client.log_batch(rid, metrics=metrics[i : i + 100], params=[Param(k, v) for k, v in params[i : i + 100]])
    for name in ("report.html", "report.md", "report.json", "run.json"):
        if (run_dir / name).is_file():
            client.log_artifact(rid, str(run_dir / name))
    models = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in s["rows"]:
            pkg = r.get("package")
            if r["baseline"] or not pkg or not Path(pkg).is_dir():
                continue
            stage = Path(tmp) / r["artifact"]
            stage.mkdir()
            for f in (
                PACKAGE_FILES
            ):  # the card and manifest, not the weights: the package directory stays where it was published
                if (Path(pkg) / f).is_file():
                    shutil.copy2(Path(pkg) / f, stage / f)
            client.log_artifacts(rid, str(stage), f"packages/{r['artifact']}")
            models.append(_register(client, record, r, rid, rec.get("choice") == r["artifact"]))
    client.set_tag(rid, "quantpipe.models", json.dumps(models))
    logged_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    client.set_tag(rid, "quantpipe.logged_at", logged_at)
    client.log_batch(
        rid,
        tags=[
            RunTag("quantpipe.gates", json.dumps({r["artifact"]: r["gate"] for r in s["rows"] if not r["baseline"]}))
        ],
    )
    client.set_terminated(rid, "FINISHED" if record.status in RUN_DONE else "FAILED", end_time=ts)
    done = {
        "uri": uri,
        "experiment": experiment,
        "experiment_id": exp_id,
        "mlflow_run_id": rid,
        "models": models,
        "logged_at": logged_at,
    }
    _mark(run_dir, done)
    return done


def _register(client, record: RunRecord, r: dict, rid: str, recommended: bool) -> dict:
    """The package as a version of the registered model named after the recipe, tagged with its gates."""
    from mlflow.exceptions import MlflowException

    name = str(record.recipe_name or "quantpipe")
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(
            name, description=f"quantpipe packages of recipe {name}: one version per artifact per run"
        )
    manifest = Path(r["package"]) / "manifest.json"
    tags = {
        "artifact": r["artifact"],
        "method": str(r.get("method")),
        "scheme": str(r.get("scheme") or ""),
        "gate": str(r["gate"]),
        "gate_failures": "; ".join(r["gate_failures"])[:5000],
        "recommended": str(recommended).lower(),
        "quantpipe.run_id": str(record.run_id),
        "package_path": str(r["package"]),
        "manifest_sha256": _sha256(manifest) if manifest.is_file() else "",
    }
    mv = client.create_model_version(
        name,
        f"runs:/{rid}/packages/{r['artifact']}",
        run_id=rid,
        tags=tags,
        description=f"{r['artifact']} ({r.get('method')}) from quantpipe run {record.run_id}",
    )
    if recommended:
        client.set_registered_model_alias(name, "recommended", mv.version)
    return {
        "name": name,
        "version": str(mv.version),
        "artifact": r["artifact"],
        "gate": r["gate"],
        "recommended": recommended,
    }


def _params(record: RunRecord, s: dict) -> list[tuple[str, str]]:
    out = {
        "recipe_name": record.recipe_name,
        "recipe_hash": record.recipe_hash,
        "quantpipe_run_id": record.run_id,
        "quantpipe_version": record.quantpipe.version,
        "git_commit": record.quantpipe.git_commit,
        "hardware": s["provenance"]["hardware_text"],
        "hardware.cpus": record.hardware.cpus,
        "hardware.gpus": "; ".join(record.hardware.gpus) or "none",
        "artifacts": ", ".join(r["artifact"] for r in s["rows"] if not r["baseline"]),
    }
    for env, libs in record.versions.items():
        for lib, v in (libs or {}).items() if isinstance(libs, dict) else ():
            out[f"versions.{env}.{lib}"] = v
    return [(k, str(v)[:6000]) for k, v in out.items() if v is not None]


def _metrics(record: RunRecord, s: dict) -> dict:
    out = {}
    for r in s["rows"]:
        for k in FIGURES:
            if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool):
                out[f"{r['artifact']}/{k}"] = r[k]
        for k in ("ttft_p99_ms", "tpot_p99_ms"):
            v = (r.get("best_point") or {}).get(k)
            if isinstance(v, (int, float)):
                out[f"{r['artifact']}/{k}"] = v
        if not r["baseline"]:
            out[f"{r['artifact']}/gate_pass"] = 1.0 if r["gate"] == "PASS" else 0.0
    for sid, st in record.stages.items():
        if st.wall_s is not None:
            out[f"stages/{sid.replace(':', '.')}/wall_s"] = st.wall_s
    if record.wall_s is not None:
        out["run/wall_s"] = record.wall_s
    return out


def _mark(run_dir: Path, entry: dict) -> None:
    path = Path(run_dir) / MARKER
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    servers = [x for x in data.get("servers", []) if isinstance(x, dict) and x.get("uri") != entry["uri"]] + [entry]
    tmp = path.with_name("." + MARKER + ".tmp")
    tmp.write_text(json.dumps({"servers": servers}, indent=2) + "\n")
    tmp.replace(path)


def _ms(iso) -> int | None:
    import calendar

    try:
        return calendar.timegm(time.strptime(str(iso), "%Y-%m-%dT%H:%M:%SZ")) * 1000
    except (ValueError, OverflowError):
        return None


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def push_missing(out_dir: Path, uri: str, experiment: str | None = None) -> tuple[list[str], list[str]]:
    """Log every finished run in out_dir that mlflow.json does not show as logged to `uri`; (pushed run ids, already there)."""
    from .history import load_runs

    pushed, there = [], []
    reachable(uri)
    for record, run_dir in load_runs(out_dir):
        if logged(run_dir, uri):
            there.append(str(record.run_id))
            continue
        log_run(run_dir, uri, experiment)
        pushed.append(str(record.run_id))
    return pushed, there


def _recipe_experiment(record: RunRecord) -> str | None:
    """The experiment the recipe named (tracking.mlflow.experiment), else None (the recipe's name)."""
    return ((record.recipe.get("tracking") or {}).get("mlflow") or {}).get("experiment")
