"""`quantpipe run`: one recipe's stages on this host, with a live line per running stage; several recipes as one
matrix sharing the stage cache; or the stages as Ray tasks (`--executor ray`). `--dry-run` prints each plan with its
pre-flight estimates and writes nothing. The options are checked before anything is built (bad input exits 2); when the
run ends the console shows its decision, then the run is logged to MLflow and the history refreshed where asked for,
neither of which can fail the run.

    quantpipe run recipes/demo.yaml --dry-run
    quantpipe run recipes/demo.yaml --stages quantize,evaluate --artifacts awq
    quantpipe run recipes/demo-tiny.yaml recipes/demo.yaml --matrix-dir out/matrix
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import click

from .cli_input import BadInput, load_checked, split_csv, tracking_target


def _console(quiet: bool = False):
    from rich.console import Console

    return Console(
        stderr=True, highlight=False, soft_wrap=True, force_terminal=False if quiet else None
    )  # --quiet: no control codes


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
        from .run.record import RunRecord

        try:
            summary = summarize(RunRecord.read(run_dir / "run.json"))
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


STAGE_HELP = "Comma-separated stage kinds (merge, quantize, evaluate, benchmark, package) or stage ids (quantize:awq); 'all' for every stage."


@click.command()
@click.argument("recipes", metavar="RECIPE [RECIPE ...]", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--dry-run", is_flag=True, help="Print the plan (stages, cache hit/miss, environment) and write nothing.")
@click.option("--force", "force", default=None, help="Rebuild these stages even if cached. " + STAGE_HELP)
@click.option("--stages", default=None, help="Run only these stage kinds (and what they need). " + STAGE_HELP)
@click.option("--artifacts", default=None, help="Build only these artifacts (comma-separated names).")
@click.option("--wait", is_flag=True, help="If another run holds the output directory, wait for it instead of failing.")
@click.option(
    "--stage-timeout",
    type=click.FloatRange(min=0),
    default=None,
    metavar="MINUTES",
    help="Stop any stage that runs longer than this (and its processes; a benchmark sharing its GPU does not count the "
    "time it waits for its turn to measure); the run goes on with the others and exits non-zero. Default: 10x each "
    "stage's pre-flight time estimate, at least 30 min (--dry-run prints it); 0: no deadline.",
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
    "--gpu-memory",
    "gpu_memory",
    default=None,
    metavar="SIZE",
    help="Use at most SIZE of each GPU (e.g. 40GiB: a run on an 80 GB card sized as for an A100 40GB, or a card shared "
    "with other work); pre-flight, the scheduler and the servers' memory keep within it.",
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
    gpu_memory,
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
    from .run.dispatch import RunError
    from .run.runner import KINDS, Runner

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
        r = load_checked(recipe)
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
    tracking = None if matrix else tracking_target(loaded[0][0], mlflow_uri)
    kinds = split_csv(stages)
    if kinds and not kinds <= set(KINDS):
        raise BadInput(
            f"--stages: unknown stage kind(s) {', '.join(sorted(kinds - set(KINDS)))}; use {', '.join(KINDS)}"
        )
    forced = split_csv(force) or set()
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
    gpu_memory_bytes = None
    if gpu_memory is not None:
        from .stages.package import parse_size

        try:
            gpu_memory_bytes = parse_size(gpu_memory)
        except Exception:  # not a size: said below
            gpu_memory_bytes = None
        if not gpu_memory_bytes or gpu_memory_bytes < 2**30:
            raise BadInput(f"--gpu-memory {gpu_memory!r}: give a size of at least 1GiB, such as 40GiB or 38000MB")
        if executor == "ray":
            raise BadInput("--gpu-memory sizes this host's GPUs; with --executor ray, Ray places each stage: drop it")
    command = shlex.join(["quantpipe", *sys.argv[1:]])
    console = _console(quiet)
    timeout_s = stage_timeout * 60 if stage_timeout is not None else None
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
                gpu_memory_bytes=gpu_memory_bytes,
                command=command,
            )
            for rr, p in (loaded if dry_run else loaded[:1])
        ]
    except ValueError as e:  # --gpus naming a GPU this host does not have
        raise BadInput(str(e)) from None
    runner = runners[0]
    try:
        if dry_run:
            from rich.table import Table

            from .deadline import describe

            for runner, (_, recipe) in zip(runners, loaded):
                rows = runner.dry_run(forced, kinds, split_csv(artifacts))
                gpu = any(row["gpu_gib"] is not None for row in rows)
                t = Table(
                    title=f"plan for {recipe} (nothing written)",
                    caption="RAM, disk"
                    + (", GPU" if gpu else "")
                    + ": pre-flight estimates in GiB; deadline: how long "
                    "a stage may run (--stage-timeout)",
                )
                for col in ("stage", "env", "key", "cache", "RAM", *(("GPU",) if gpu else ()), "disk", "deadline"):
                    t.add_column(col, no_wrap=True)
                gib = lambda v: "?" if v is None else f"{v:.2f}"  # noqa: E731
                for row in rows:
                    est = [gib(row["ram_gib"]), *((gib(row["gpu_gib"]),) if gpu else ()), gib(row["disk_gib"])]
                    t.add_row(row["stage"], row["env"], row["key"], row["cache"], *est, describe(row["deadline_s"]))
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
                    artifacts=split_csv(artifacts),
                    wait=wait,
                    index_dir=Path(matrix_dir) if matrix_dir else None,
                    gpu_select=gpu_select,
                    gpu_memory_bytes=gpu_memory_bytes,
                    command=command,
                )
            )
        from contextlib import nullcontext

        from .console import LiveStatus

        live = LiveStatus(console) if console.is_terminal and not quiet and not ctx.obj["verbose"] else None
        runner.procs.watch = live
        with live or nullcontext():
            code = runner.run(forced, kinds, split_csv(artifacts), wait=wait)
        _after_run(console, runner, tracking, refresh_history, plain=quiet or not console.is_terminal)
    except RunError as e:
        raise BadInput(str(e)) from None
    except EnvError as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        click.echo("interrupted: running stages were stopped; committed stages stay cached", err=True)
        sys.exit(130)
    sys.exit(code)
