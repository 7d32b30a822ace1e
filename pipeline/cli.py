"""quantpipe's command line.

    quantpipe check recipes/demo.yaml       # validate, print the resolved recipe
    quantpipe run recipes/demo.yaml --dry-run
    quantpipe run recipes/demo.yaml         # merge -> quantize -> evaluate -> benchmark -> package -> report
    quantpipe schema > recipe.schema.json
    quantpipe verify out/demo/packages/awq
    quantpipe compare RUN_A RUN_B
    quantpipe doctor                        # platform, GPUs, environments, which schemes vLLM serves here
    quantpipe history out/demo              # history.html: every artifact's figures across runs
    quantpipe cache prune --keep-runs 3     # remove stage cache entries no recent run or package needs

Exit codes: 0 ok; 1 a stage or the run failed; 2 bad input (recipe, arguments); 3 a release gate
or a comparison found a regression.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import click

from .cli_cache import cache
from .cli_input import EXIT_GATE, BadInput, check_uri, load_checked
from .cli_run import run
from .recipe import json_schema


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
    r = load_checked(recipe)
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


main.add_command(run)
main.add_command(cache)


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
        check_uri("--push-mlflow", push_uri)
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

    where = "give a package directory (<output_dir>/packages/<artifact>)"
    if not Path(package_dir).is_dir():
        raise BadInput(f"{package_dir}: not a directory; {where}")
    if not (Path(package_dir) / "manifest.json").exists():
        raise BadInput(f"{package_dir}: no manifest.json there, so not a quantpipe package; {where}")
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
