"""Several recipes in one `quantpipe run`: one shared stage cache, one report per recipe, one index of the whole matrix.
Every recipe is planned and pre-flighted (with Ray, every node is checked too) before anything is written, so a bad
recipe or node refuses the whole call; then the recipes run, one after another locally, side by side with Ray. An entry
two recipes share (the merge of a common base and adapter, its baseline evaluation) is built once. The index goes to
--matrix-dir (default: the output directories' common parent).

    quantpipe run recipes/*.yaml --executor ray --cache /shared/quantpipe-cache     # the nightly matrix
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

from .. import preflight
from ..envs import EnvError
from .dispatch import RunError, is_forced
from .record import STAGE_OK, ArtifactRecord, RunRecord
from .runner import EXIT_FAILED, EXIT_GATE, Runner

log = logging.getLogger(__name__)


def matrix_dir(out_dirs: list[Path], given: Path | None) -> Path:
    """Where the index goes: --matrix-dir, else the common parent of every recipe's output directory."""
    if given is not None:
        return Path(given)
    common = Path(os.path.commonpath([str(Path(d).resolve()) for d in out_dirs]))
    if len(out_dirs) > 1 and common in [Path(d).resolve() for d in out_dirs]:
        common = common.parent
    if common == Path(common.anchor):
        raise RunError(
            "the recipes' output directories share no parent folder for the matrix index; give --matrix-dir DIR"
        )
    return common


def run_matrix(
    recipes: list,
    *,
    executor: str = "local",
    address: str = "auto",
    jobs: int | None = None,
    console=None,
    verbose: bool = False,
    stage_timeout_s: float | None = None,
    force=frozenset(),
    kinds=None,
    artifacts=None,
    wait: bool = False,
    index_dir: Path | None = None,
    after=None,
    gpu_select: str | None = None,
    gpu_memory_bytes: int | None = None,
    command: str | None = None,
) -> int:
    """Run every (recipe, path) in `recipes`; write the index when there are several (or index_dir is given); the exit code."""
    outs = [Path(r.output_dir).resolve() for r, _ in recipes]
    for i, o in enumerate(outs):
        if o in outs[:i]:
            raise RunError(
                f"{recipes[outs.index(o)][1]} and {recipes[i][1]} both write to output_dir {o}; give each recipe its own output_dir"
            )
    where = matrix_dir(outs, index_dir) if len(recipes) > 1 or index_dir else None
    cluster = None
    if executor == "ray":
        from .ray_executor import RayCluster

        cluster = RayCluster(address, jobs).connect()
    try:
        runners = [
            Runner(
                r,
                Path(p),
                console=console,
                verbose=verbose,
                stage_timeout_s=stage_timeout_s,
                jobs=jobs,
                gpu_select=gpu_select,
                executor=cluster,
                gpu_memory_bytes=gpu_memory_bytes,
                command=command,
            )
            for r, p in recipes
        ]
        if cluster is not None and len(runners) > 1:  # side by side on one console: say whose stage each line is
            for runner in runners:
                runner.say = _prefixed(runner.say, runner.recipe.name)
        plans = [runner.plan(dry_run=False, kinds=kinds, artifacts=artifacts) for runner in runners]
        if cluster is not None:  # one probe of every node for the whole matrix
            steps = [s for _, st in plans for s in st]
            cluster.check([runner.cache.root for runner in runners], {s.env for s in steps}, {s.kind for s in steps})
        for runner, (base_dir, steps) in zip(runners, plans):
            todo = {s.id for s in steps if is_forced(s, force) or not (s.key and runner.cache.lookup(s.id, s.key))}
            try:
                if runner.executor:
                    runner.executor.preflight(runner.recipe, steps, base_dir, runner.cache.root, runner.out_dir, todo)
                else:
                    preflight.check(
                        runner.recipe, steps, base_dir, runner.cache.root, runner.out_dir, todo, gpu_memory_bytes
                    )
            except preflight.PreflightError as e:
                raise RunError(f"{runner.recipe_path}: {e}") from None
        t0 = time.time()
        results = _run_all(runners, cluster, force, kinds, artifacts, wait)
        for runner in runners:
            if after is not None and runner.run_dir is not None:
                after(runner)
        if len(runners) == 1 and "refused" in results[0]:
            raise RunError(results[0]["refused"])
        if where is None:
            return results[0]["code"]
        entries = write_index(where, runners, results, t0, executor, address if cluster else None)
    finally:
        if cluster is not None:
            cluster.shutdown()
    if console is not None:
        console.print(f"matrix: {len(entries)} recipes, index {where / 'matrix.html'}", highlight=False)
    codes = [e["exit_code"] for e in entries]
    if any(c not in (0, EXIT_GATE) for c in codes):
        return EXIT_FAILED
    return EXIT_GATE if EXIT_GATE in codes or any(e["regressions"].get("findings") for e in entries) else 0


def _run_one(runner: Runner, force, kinds, artifacts, wait: bool) -> dict:
    try:
        return {"code": runner.run(force, kinds, artifacts, wait=wait)}
    except RunError as e:  # e.g. its output directory is in use by another run
        return {"code": 2, "refused": str(e)}
    except EnvError as e:
        return {"code": EXIT_FAILED, "error": str(e)}
    except Exception as e:  # a bug in one recipe's run must not lose the others'
        log.exception("recipe %s", runner.recipe_path)
        return {"code": EXIT_FAILED, "error": f"{type(e).__name__}: {e}"}


def _run_all(runners: list[Runner], cluster, force, kinds, artifacts, wait: bool) -> list[dict]:
    """One after another on this host; side by side on a Ray cluster (each recipe's runner in its own thread)."""
    if cluster is None or len(runners) == 1:
        return [_run_one(r, force, kinds, artifacts, wait) for r in runners]
    results: list[dict] = [{} for _ in runners]

    def one(i: int) -> None:
        results[i] = _run_one(runners[i], force, kinds, artifacts, wait)

    threads = [
        threading.Thread(target=one, args=(i,), name=f"recipe-{i}-{r.recipe.name}", daemon=True)
        for i, r in enumerate(runners)
    ]

    def stop(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = (
        {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
        if threading.current_thread() is threading.main_thread()
        else {}
    )
    try:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.5)
    except KeyboardInterrupt:  # stop every recipe's stages; each run records what it had, then the interrupt goes on
        cluster.stopping = True
        for r in runners:
            r.procs.stop_all()
        for t in threads:
            t.join(60)
        raise
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
    return results


def _prefixed(say, name: str):
    from rich.markup import escape

    return lambda msg: say(f"[dim]{escape(name)}[/dim] {msg}")


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _record(path: Path) -> RunRecord:
    """The run's record, or an empty one where run.json is missing or unreadable."""
    try:
        return RunRecord.read(path)
    except (OSError, ValueError):
        return RunRecord()


def _outcome(art: ArtifactRecord) -> dict:
    """What the record holds of an artifact's outcome (None for what it does not hold)."""
    held = art.model_dump(exclude_unset=True)
    return {k: held.get(k) for k in ("method", "gate", "gate_failures", "package")}


def write_index(
    where: Path, runners: list[Runner], results: list[dict], t0: float, executor: str, address: str | None
) -> list[dict]:
    """matrix.json and matrix.html: one row per recipe (its run, status, recommendation, gates, reuse, regressions)."""
    from ..report import CompareError, compare_runs

    entries, built = [], {}
    records = [_record(r.run_dir / "run.json") if r.run_dir else RunRecord() for r in runners]
    for runner, rec in zip(runners, records):
        for sid, st in rec.stages.items():
            if st.cache in ("miss", "forced", "rebuilt") and st.status == STAGE_OK:
                built[(sid, st.key)] = runner.recipe.name
    for runner, res, rec in zip(runners, results, records):
        run_dir = runner.run_dir if rec.model_fields_set else None  # a run that left no record has no folder to show
        e = {
            "recipe": str(runner.recipe_path),
            "name": runner.recipe.name,
            "output_dir": str(runner.out_dir),
            "exit_code": res["code"],
            "status": rec.status or ("refused" if "refused" in res else "failed"),
            "error": res.get("refused") or res.get("error") or rec.error,
            "run_id": rec.run_id,
            "run_dir": str(run_dir) if run_dir else None,
            "wall_s": rec.wall_s,
            "report": str(run_dir / "report.html") if run_dir and (run_dir / "report.html").exists() else None,
            "recommendation": {
                k: (_read(run_dir / "report.json").get("recommendation") or {}).get(k) for k in ("choice", "sentence")
            }
            if run_dir
            else {},
            "artifacts": {a: _outcome(v) for a, v in rec.artifacts.items()},
            "reused": {
                sid: built[(sid, st.key)]
                for sid, st in rec.stages.items()
                if st.cache == "hit" and built.get((sid, st.key), runner.recipe.name) != runner.recipe.name
            },
            "regressions": {},
        }
        if run_dir:
            try:
                cmp = compare_runs(run_dir, None, against="last-good")
                e["regressions"] = {"against": cmp["run_b"]["dir"], "findings": cmp["findings"]}
            except CompareError as ce:
                e["regressions"] = {"against": None, "note": str(ce)}
        entries.append(e)
    where.mkdir(parents=True, exist_ok=True)
    index = {
        "started_at": _iso(t0),
        "finished_at": _iso(time.time()),
        "executor": executor,
        "address": address,
        "caches": sorted({str(r.cache.root) for r in runners}),
        "recipes": entries,
    }
    for name, text in (
        ("matrix.json", json.dumps(index, indent=2, default=str) + "\n"),
        ("matrix.html", _html(index, where)),
    ):
        tmp = where / f".{name}.tmp"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, where / name)
    return entries


HTML = """<!doctype html><html><head><meta charset="utf-8"><title>quantpipe matrix {{ i.started_at }}</title>
<style>body{font:14px system-ui,sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px;
vertical-align:top;text-align:left}.PASS{color:#080}.FAIL{color:#c00}.bad{color:#c00}</style></head><body>
<h1>quantpipe matrix</h1><p>{{ i.recipes|length }} recipes, {{ i.executor }} executor{% if i.address %} ({{ i.address }}){% endif %},
{{ i.started_at }} to {{ i.finished_at }}; stage cache {{ i.caches|join(", ") }}.</p>
<table><tr><th>recipe</th><th>status</th><th>recommendation</th><th>gates</th><th>reused from the matrix</th><th>against the last good run</th></tr>
{% for e in i.recipes %}<tr><td><b>{{ e.name }}</b><br>{{ e.recipe }}{% if e.report %}<br><a href="{{ rel(e.report) }}">report</a>{% endif %}</td>
<td class="{{ '' if e.status == 'ok' else 'bad' }}">{{ e.status }}{% if e.wall_s is not none %} ({{ '%.0f' % e.wall_s }} s){% endif %}
{% if e.error %}<br>{{ e.error }}{% endif %}</td><td>{{ e.recommendation.sentence or "" }}</td>
<td>{% for a, v in e.artifacts.items() %}{{ a }}: <span class="{{ (v.gate or "")|replace(" ", "-") }}">{{ v.gate }}</span>{% if v.gate_failures %} ({{ v.gate_failures|join("; ") }}){% endif %}<br>{% endfor %}</td>
<td>{% for s, who in e.reused.items() %}{{ s }} (built for {{ who }})<br>{% endfor %}</td>
<td>{% if e.regressions.findings %}<span class="bad">{{ e.regressions.findings|join("; ") }}</span>{% elif e.regressions.against %}no regression
{% else %}{{ e.regressions.note or "" }}{% endif %}</td></tr>
{% endfor %}</table></body></html>
"""


def _html(index: dict, where: Path) -> str:
    import jinja2

    env = jinja2.Environment(autoescape=True)
    return env.from_string(HTML).render(i=index, rel=lambda p: os.path.relpath(p, where))


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
