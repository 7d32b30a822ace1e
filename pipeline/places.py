"""Where a run writes against what it reads: output_dir and the stage cache must be directories quantpipe may create, apart from every input.

A run writes `<output_dir>/runs/`, `packages/` and a lock file, and `<cache>/stages/`, `tmp/`, `hashes.json` and `runs.jsonl`. Inside an
input (the base model, an adapter, a task folder) those files would change the input's content hash, so every later run
would miss the cache; an input inside them could be replaced or swept. Checked before anything is written:

    from quantpipe.places import problems
    problems(recipe)   # -> ["output_dir: /m/out is inside base.model (/m); ...", ...]
"""

from __future__ import annotations

import os
from pathlib import Path

from .common.links import inside, real_path

CACHE_WRITES = (
    "stages",
    "tmp",
    "hashes.json",
    "runs.jsonl",
)  # what the runner writes under the cache root; the rest of it is not ours


def inputs(recipe) -> list[tuple[str, Path]]:
    """(field, path) of every local file or folder the recipe reads."""
    out = []
    if recipe.base.is_local:
        out.append(("base.model", Path(recipe.base.model)))
    out += [(f"adapters.{i}.path", Path(a.path)) for i, a in enumerate(recipe.adapters)]
    if recipe.calibration:
        out += [
            (f"calibration.sources.{i}.path", Path(s.path)) for i, s in enumerate(recipe.calibration.sources) if s.path
        ]
    ev = recipe.evaluation
    if ev.lm_eval and ev.lm_eval.include_path:
        out.append(("evaluation.lm_eval.include_path", Path(ev.lm_eval.include_path)))
    if ev.validation:
        out.append(("evaluation.validation.path", Path(ev.validation.path)))
        if ev.validation.json_schema:
            out.append(("evaluation.validation.json_schema", Path(ev.validation.json_schema)))
    return out


def _same(p: Path) -> str:
    return "the same folder as" if p.is_dir() else "the same path as"


def _creatable(field: str, d: Path) -> str | None:
    """Why `d` cannot be used as a directory quantpipe creates and writes in, or None."""
    if d.exists() and not d.is_dir():
        return f"{field}: {d} is a file; give a directory (it is created if missing)"
    p = d
    while not p.exists() and p != p.parent:
        p = p.parent
    if not p.is_dir():
        return f"{field}: {p} is a file, so {d} cannot be created there; give a directory path"
    if not os.access(p, os.W_OK | os.X_OK):
        return (
            f"{field}: no permission to write in {p}"
            + ("" if p == d else f", where {d} would be created")
            + "; give a directory you can write to"
        )
    return None


def problems(recipe) -> list[str]:
    """Every problem with output_dir and the cache directory: not a directory, not writable, inside or around an input."""
    from .run.hub import cache_root  # $QUANTPIPE_CACHE or ~/.cache/quantpipe when the recipe sets no cache_dir

    out_dir, cache = Path(recipe.output_dir), cache_root(recipe)
    cache_field = (
        "cache_dir"
        if recipe.cache_dir
        else f"the stage cache ({'$QUANTPIPE_CACHE' if os.environ.get('QUANTPIPE_CACHE') else 'default'})"
    )
    out = [p for p in (_creatable("output_dir", out_dir), _creatable(cache_field, cache)) if p]
    real_out, real_cache = real_path(out_dir), real_path(cache)
    for field, path in inputs(recipe):
        real = real_path(path)
        if inside(real_out, real):
            out.append(
                f"output_dir: {out_dir} is {_same(path) if real_out == real else 'inside'} {field} ({path}); a run would "
                "write runs/ and packages/ into your input (changing its content hash, so later runs miss the cache): "
                "put output_dir outside it"
            )
        elif inside(real, real_out):
            out.append(
                f"output_dir: {out_dir} contains {field} ({path}); a run writes runs/ and packages/ there, beside your input: "
                "put output_dir in a folder of its own, or move the input out"
            )
        if inside(real_cache, real):
            out.append(
                f"{cache_field}: {cache} is {_same(path) if real_cache == real else 'inside'} {field} ({path}); the stage "
                "cache would write into your input: set cache_dir (or $QUANTPIPE_CACHE) to a folder outside it"
            )
        elif any(inside(real, real_cache / w) for w in CACHE_WRITES):
            out.append(
                f"{field}: {path} is inside the stage cache's own entries ({cache}), which are replaced and swept as runs "
                "go; copy it out of the cache and point the recipe at the copy"
            )
    return out
