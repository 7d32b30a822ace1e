"""What quantpipe's commands do with their input before anything runs: the recipe loaded and checked against
everything knowable (its schema, then `quantpipe.inputs`), an MLflow URI checked as the recipe's own is, a comma-separated
option split into a set. Bad input raises `BadInput`, which exits 2 with a sentence that names the problem and the fix,
never a traceback; a failed release gate or a comparison that finds a regression exits 3 (`EXIT_GATE`).

    r = load_checked("recipes/demo.yaml")  # BadInput: "recipes/demo.yaml: 1 problem(s) found before running anything: ..."
    split_csv("quantize, evaluate")        # {"quantize", "evaluate"}
"""

from __future__ import annotations

import click

from .recipe import RecipeError, load

EXIT_USAGE, EXIT_GATE = 2, 3


class BadInput(click.ClickException):
    exit_code = EXIT_USAGE


def tracking_target(recipe, uri: str | None) -> tuple[str, str | None] | None:
    """(MLflow URI, experiment) from --mlflow or the recipe's tracking.mlflow, checked like the recipe; None without either."""
    cfg = recipe.tracking.mlflow
    if uri is None:
        return (cfg.uri, cfg.experiment) if cfg else None
    check_uri("--mlflow", uri)
    return uri, cfg.experiment if cfg else None


def check_uri(option: str, uri: str) -> None:
    """An MLflow URI as the recipe's tracking.mlflow.uri is checked (no credentials in it); bad input exits 2."""
    from pydantic import ValidationError

    from .recipe.schema import MlflowTracking

    try:
        MlflowTracking(uri=uri)
    except ValidationError as e:
        raise BadInput(f"{option}: {e.errors()[0]['msg'].removeprefix('Value error, ')}") from None


def load_checked(path: str):
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


def split_csv(value: str | None) -> set[str] | None:
    return {v.strip() for v in value.split(",") if v.strip()} if value else None
