"""quantpipe's command line.

    quantpipe check recipes/demo.yaml       # validate, print the resolved recipe
    quantpipe run recipes/demo.yaml --dry-run
    quantpipe run recipes/demo.yaml         # merge -> quantize -> evaluate -> benchmark -> package -> report
    quantpipe schema > recipe.schema.json
    quantpipe verify out/demo/packages/awq
    quantpipe compare RUN_A RUN_B
    quantpipe doctor                        # platform, GPUs, environments, which schemes vLLM serves here
    quantpipe history out/demo              # history.html: every artifact's figures across runs

Exit codes: 0 ok; 1 a stage or the run failed; 2 bad input (recipe, arguments); 3 a release gate
or a comparison found a regression.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import click

from .recipe import RecipeError, json_schema, load

EXIT_USAGE, EXIT_GATE = 2, 3


class BadInput(click.ClickException):
    exit_code = EXIT_USAGE


def _console(quiet: bool = False):
    from rich.console import Console

    return Console(
        stderr=True, highlight=False, soft_wrap=True, force_terminal=False if quiet else None
    )  # --quiet: no control codes


def _tracking(recipe, uri: str | None) -> tuple[str, str | None] | None:
    """(MLflow URI, experiment) from --mlflow or the recipe's tracking.mlflow, checked like the recipe; None without either."""
    cfg = recipe.tracking.mlflow
    if uri is None:
        return (cfg.uri, cfg.experiment) if cfg else None
    _check_uri("--mlflow", uri)
    return uri, cfg.experiment if cfg else None


def _check_uri(option: str, uri: str) -> None:
    """An MLflow URI as the recipe's tracking.mlflow.uri is checked (no credentials in it); bad input exits 2."""
    from pydantic import ValidationError

    from .recipe.schema import MlflowTracking

    try:
        MlflowTracking(uri=uri)
    except ValidationError as e:
        raise BadInput(f"{option}: {e.errors()[0]['msg'].removeprefix('Value error, ')}") from None


def _after_run(console, runner, tracking, refresh_history: bool, plain: bool) -> None:
    """The run's decision on the console, then MLflow and the history where asked for; neither can fail the run."""
    from rich.markup import escape

    from .console import final_summary

    run_dir = runner.run_dir
    if run_dir is None:
        return
    try:
        summary = json.loads((run_dir / "report.json").read_text())
    except (OSError, ValueError):  # the report failed (the run says so): summarize the record itself
        from .report import summarize

        try:
            summary = summarize(json.loads((run_dir / "run.json").read_text()))
        except (OSError, ValueError):
            return
    report = run_dir / "report.html"
    final_summary(console, summary, report if report.is_file() else None, plain=plain)
    if tracking:
        from .tracking import MlflowUnavailable, log_run

        uri, experiment = tracking
        try:
            done = log_run(run_dir, uri, experiment)
            console.print(
                f"MLflow: logged run {escape(run_dir.name)} to {escape(uri)} (experiment {escape(done['experiment'])}, "
                f"{len(done['models'])} model version(s))",
                highlight=False,
            )
        except MlflowUnavailable as e:
            console.print(
                f"[yellow]MLflow: not logged: {escape(str(e))}; the run's files are its record, and "
                f"`quantpipe history {escape(str(runner.out_dir))} --push-mlflow {escape(uri)}` logs it later[/yellow]",
                highlight=False,
            )
    if refresh_history:
        from .history import HistoryError, write_history

        try:
            console.print(f"history: {escape(str(write_history(runner.out_dir)[1]))}", highlight=False)
        except HistoryError as e:
            console.print(f"[yellow]history: {escape(str(e))}[/yellow]", highlight=False)


def _load(path: str):
    """The recipe, checked against everything knowable before a stage runs (schema, then `quantpipe.inputs`); bad input exits 2."""
    try:
        r = load(path)
    except RecipeError as e:
        raise BadInput(str(e)) from None
    from .inputs import problems as input_problems

    try:
        problems = input_problems(r)
    except OSError as e:  # a path the file system refuses while looking (permissions, a name too long): name it
        raise BadInput(
            f"{path}: cannot check a path it names: {e.strerror or e}: {e.filename!r}; fix that path"
        ) from None
    if problems:
        raise BadInput(
            f"{path}: {len(problems)} problem(s) found before running anything:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    return r


def _csv(value: str | None) -> set[str] | None:
    return {v.strip() for v in value.split(",") if v.strip()} if value else None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="quantpipe", message="quantpipe %(version)s")
@click.option("-v", "--verbose", is_flag=True, help="Show the stages' own output (library logs, progress bars).")
@click.pass_context
def main(ctx, verbose):
    """Build quantized LLM artifacts from a recipe, measured: merge, quantize, validate, benchmark, package."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for h in logging.root.handlers:  # the console shows warnings; run.log (runner) gets everything
        h.setLevel(logging.INFO if verbose else logging.WARNING)
    logging.getLogger("quantpipe").setLevel(logging.INFO)
    ctx.obj = {"verbose": verbose}


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
def check(recipe):
    """Validate RECIPE without running anything; print it resolved, with defaults."""
    r = _load(recipe)
    click.echo(json.dumps(r.model_dump(mode="json"), indent=2))
    click.echo(f"{recipe}: OK ({len(r.artifacts)} artifact(s): {', '.join(a.name for a in r.artifacts)})", err=True)


@main.command()
def schema():
    """Print the recipe's JSON schema (for editor completion)."""
    click.echo(json.dumps(json_schema(), indent=2))


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--no-vllm", is_flag=True, help="Do not import vLLM in the serve environment (faster; no scheme rows).")
def doctor(as_json, no_vllm):
    """What this host can build and serve: platform, GPUs, memory, the stage environments and their versions, and
    which quantized schemes vLLM runs here. Exit 1 when an environment is missing or broken, or vLLM sees no GPU."""
    from .doctor import problems, report, table
    from .envs import EnvError, host_platform

    try:
        host_platform()
    except EnvError as e:
        raise BadInput(str(e)) from None
    rep = report(probe_vllm=not no_vllm)
    if as_json:
        click.echo(json.dumps(rep, indent=2))
    else:
        from rich.console import Console

        Console(highlight=False).print(table(rep))
    found = problems(rep)
    if found:
        raise click.ClickException("; ".join(found))


STAGE_HELP = "Comma-separated stage kinds (merge, quantize, evaluate, benchmark, package) or stage ids (quantize:awq); 'all' for every stage."


@main.command()
@click.argument("recipes", metavar="RECIPE [RECIPE ...]", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--dry-run", is_flag=True, help="Print the plan (stages, cache hit/miss, environment) and write nothing.")
@click.option("--force", "force", default=None, help="Rebuild these stages even if cached. " + STAGE_HELP)
@click.option("--stages", default=None, help="Run only these stage kinds (and what they need). " + STAGE_HELP)
@click.option("--artifacts", default=None, help="Build only these artifacts (comma-separated names).")
@click.option("--wait", is_flag=True, help="If another run holds the output directory, wait for it instead of failing.")
@click.option(
    "--stage-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    metavar="MINUTES",
    help="Stop any stage that runs longer than this (and its processes; a benchmark sharing its GPU does not count the "
    "time it waits for its turn to measure); the run goes on with the others and exits non-zero.",
)
@click.option(
    "--jobs",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="At most N stages at once (default: 1 without GPUs, 4 per GPU with them; GPUs and memory permitting). "
    "Without GPUs, N > 1 shares the CPU; a benchmark still measures with the host to itself.",
)
@click.option(
    "--gpus", "gpu_select", default=None, metavar="0,1", help="Use only these GPUs (indices as nvidia-smi lists them)."
)
@click.option(
    "--executor",
    type=click.Choice(["local", "ray"]),
    default="local",
    show_default=True,
    help="Where stages run: on this host, or as Ray tasks on a Ray cluster's nodes (docs/cluster.md).",
)
@click.option(
    "--address",
    default=None,
    metavar="auto|HOST:PORT",
    help="With --executor ray: the cluster's head (default auto: $RAY_ADDRESS, else the cluster `ray start` began on this host).",
)
@click.option(
    "--cache",
    "cache_dir",
    default=None,
    type=click.Path(file_okay=False),
    metavar="DIR",
    help="The stage cache of every recipe (over cache_dir and $QUANTPIPE_CACHE); with Ray, storage every node mounts at this path.",
)
@click.option(
    "--matrix-dir",
    default=None,
    type=click.Path(file_okay=False),
    metavar="DIR",
    help="Where several recipes' index goes (matrix.json, matrix.html); default: their output directories' common parent.",
)
@click.option(
    "-q",
    "--quiet",
    is_flag=True,
    help="No live status lines and no colour: plain lines, as for a CI log (also when not on a terminal).",
)
@click.option(
    "--mlflow",
    "mlflow_uri",
    default=None,
    metavar="URI",
    help="Log the run to this MLflow tracking server and register its packages "
    "(overrides the recipe's tracking.mlflow.uri); a server that is down does not fail the run.",
)
@click.option(
    "--history",
    "refresh_history",
    is_flag=True,
    help="Refresh <output_dir>/history.html after the run (as `quantpipe history`).",
)
@click.pass_context
def run(
    ctx,
    recipes,
    dry_run,
    force,
    stages,
    artifacts,
    wait,
    stage_timeout,
    jobs,
    gpu_select,
    executor,
    address,
    cache_dir,
    matrix_dir,
    quiet,
    mlflow_uri,
    refresh_history,
):
    """Run each RECIPE's stages, reusing every cached one. Several recipes share the stage cache (an entry they have in
    common is built once), each gets its report, and the matrix one index (matrix.html)."""
    from .envs import EnvError, platform_override
    from .run.runner import KINDS, RunError, Runner

    try:
        platform_override()
    except EnvError as e:
        raise BadInput(str(e)) from None
    if address is not None and executor != "ray":
        raise BadInput("--address names a Ray cluster: add --executor ray, or drop --address")
    if gpu_select and executor == "ray":
        raise BadInput(
            "--gpus picks this host's GPUs; with --executor ray, Ray places each stage on a node's GPUs: drop --gpus"
        )
    loaded = []
    for recipe in recipes:
        r = _load(recipe)
        if cache_dir:
            from .places import problems as place_problems

            r = r.model_copy(update={"cache_dir": str(Path(cache_dir).resolve())})
            if place_problems(r):
                raise BadInput(f"--cache: {'; '.join(place_problems(r))}".replace("cache_dir:", "").replace("  ", " "))
        loaded.append((r, recipe))
    matrix = len(loaded) > 1 or executor == "ray" or matrix_dir
    if matrix and (mlflow_uri or refresh_history):
        raise BadInput(
            "--mlflow and --history log one recipe's run on this host: run each recipe on its own for them, or drop them"
        )
    tracking = None if matrix else _tracking(loaded[0][0], mlflow_uri)
    kinds = _csv(stages)
    if kinds and not kinds <= set(KINDS):
        raise BadInput(
            f"--stages: unknown stage kind(s) {', '.join(sorted(kinds - set(KINDS)))}; use {', '.join(KINDS)}"
        )
    forced = _csv(force) or set()
    targets = {a.name for rr, _ in loaded for a in rr.artifacts} | {"baseline"}
    bad = {
        f
        for f in forced
        if f != "all" and (f.split(":")[0] not in KINDS or (":" in f and f.split(":", 1)[1] not in targets))
    }
    if bad:
        raise BadInput(
            f"--force: unknown stage(s) {', '.join(sorted(bad))}; use a kind ({', '.join(KINDS)}), a stage id like quantize:awq, or all"
        )
    console = _console(quiet)
    timeout_s = stage_timeout * 60 if stage_timeout else None
    try:
        runners = [
            Runner(
                rr,
                Path(p),
                console=console,
                verbose=ctx.obj["verbose"],
                stage_timeout_s=timeout_s,
                jobs=jobs,
                gpu_select=gpu_select,
            )
            for rr, p in (loaded if dry_run else loaded[:1])
        ]
    except ValueError as e:  # --gpus naming a GPU this host does not have
        raise BadInput(str(e)) from None
    runner = runners[0]
    try:
        if dry_run:
            from rich.table import Table

            for runner, (_, recipe) in zip(runners, loaded):
                rows = runner.dry_run(forced, kinds, _csv(artifacts))
                gpu = any(row["gpu_gib"] is not None for row in rows)
                t = Table(
                    title=f"plan for {recipe} (nothing written)",
                    caption="RAM, disk" + (", GPU" if gpu else "") + ": pre-flight estimates in GiB",
                )
                for col in ("stage", "env", "key", "cache", "RAM", *(("GPU",) if gpu else ()), "disk"):
                    t.add_column(col, no_wrap=True)
                gib = lambda v: "?" if v is None else f"{v:.2f}"  # noqa: E731
                for row in rows:
                    est = [gib(row["ram_gib"]), *((gib(row["gpu_gib"]),) if gpu else ()), gib(row["disk_gib"])]
                    t.add_row(row["stage"], row["env"], row["key"], row["cache"], *est)
                console.print(t)
                for p in runner.preflight_problems:
                    console.print(f"[yellow]pre-flight: would refuse:[/yellow] {p}")
            return
        if matrix:  # the matrix, or a recipe's stages as Ray tasks (run/matrix.py)
            from .run.matrix import run_matrix

            sys.exit(
                run_matrix(
                    loaded,
                    executor=executor,
                    address=address or "auto",
                    jobs=jobs,
                    console=console,
                    verbose=ctx.obj["verbose"],
                    stage_timeout_s=timeout_s,
                    force=forced,
                    kinds=kinds,
                    artifacts=_csv(artifacts),
                    wait=wait,
                    index_dir=Path(matrix_dir) if matrix_dir else None,
                    gpu_select=gpu_select,
                )
            )
        from contextlib import nullcontext

        from .console import LiveStatus

        live = LiveStatus(console) if console.is_terminal and not quiet and not ctx.obj["verbose"] else None
        runner.procs.watch = live
        with live or nullcontext():
            code = runner.run(forced, kinds, _csv(artifacts), wait=wait)
        _after_run(console, runner, tracking, refresh_history, plain=quiet or not console.is_terminal)
    except RunError as e:
        raise BadInput(str(e)) from None
    except EnvError as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        click.echo("interrupted: running stages were stopped; committed stages stay cached", err=True)
        sys.exit(130)
    sys.exit(code)


@main.command()
@click.argument("output_dir", type=click.Path(file_okay=False))
@click.option("--last", type=click.IntRange(min=1), default=None, metavar="N", help="Show only the last N runs.")
@click.option(
    "--push-mlflow",
    "push_uri",
    default=None,
    metavar="URI",
    help="Also log to this MLflow server every run it has not received yet.",
)
@click.option(
    "--experiment",
    default=None,
    help="MLflow experiment for --push-mlflow (default: the recipe's tracking.mlflow.experiment, else its name).",
)
def history(output_dir, last, push_uri, experiment):
    """Write OUTPUT_DIR/history.html and history.json: each artifact's figures across runs, regressions flagged."""
    from .history import HistoryError, write_history

    if push_uri:
        _check_uri("--push-mlflow", push_uri)
    try:
        paths = write_history(Path(output_dir), last)
    except HistoryError as e:
        raise BadInput(str(e)) from None
    n = len(json.loads(paths[0].read_text())["runs"])
    click.echo(f"history: {paths[1]} ({n} run(s)); data: {paths[0]}")
    if push_uri:
        from .tracking import MlflowUnavailable, push_missing

        try:
            pushed, there = push_missing(Path(output_dir), push_uri, experiment)
        except MlflowUnavailable as e:
            raise click.ClickException(
                f"{e}; nothing was lost: the runs not logged yet are pushed by the next --push-mlflow"
            ) from None
        click.echo(
            f"MLflow {push_uri}: logged {len(pushed)} run(s){': ' + ', '.join(pushed) if pushed else ''}; {len(there)} were there already"
        )


@main.command()
@click.argument("package_dir", type=click.Path(file_okay=False))
def verify(package_dir):
    """Re-hash every file of a package against its manifest.json; exit 1 naming any mismatch."""
    from .stages.package import verify_package

    problems = verify_package(Path(package_dir))
    if problems:
        for p in problems:
            click.echo(f"MISMATCH {p}", err=True)
        raise click.ClickException(f"{package_dir}: {len(problems)} problem(s); the package is not as it was built")
    click.echo(f"{package_dir}: OK, every file matches manifest.json")


@main.command()
@click.argument("run_a", type=click.Path())
@click.argument("run_b", type=click.Path(), required=False)
@click.option(
    "--against",
    type=click.Choice(["last-good"]),
    default=None,
    help="Compare RUN_A with the last good run in its output directory.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON.")
def compare(run_a, run_b, against, as_json):
    """Compare two runs (run directories or run.json files): accuracy and latency deltas, noise-aware. Exit 3 on regression."""
    from .report import CompareError, compare_runs

    if (run_b is None) == (against is None):
        raise BadInput("give RUN_B, or --against last-good")
    try:
        result = compare_runs(Path(run_a), Path(run_b) if run_b else None, against=against)
    except CompareError as e:
        raise BadInput(str(e)) from None
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        click.echo(result["text"])
    sys.exit(EXIT_GATE if result["regression"] else 0)


if __name__ == "__main__":
    main()
