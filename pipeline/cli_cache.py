"""`quantpipe cache`: what the stage cache holds, and `quantpipe cache prune`, which removes the entries that no
recent run, published package or running run needs (the library: run/prune.py).

    quantpipe cache                                   # entries and bytes per stage kind, which are needed
    quantpipe cache prune --keep-runs 3 --dry-run     # what would go, and the bytes it would free
    quantpipe cache prune --keep-runs 3 --cache /data/qp-cache
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import click

from .cli_input import BadInput
from .common.fmt import human_bytes
from .run.prune import DEFAULT_KEEP_RUNS, PruneError, survey
from .run.prune import prune as prune_cache

CACHE_HELP = "The stage cache (default: $QUANTPIPE_CACHE, else ~/.cache/quantpipe)."


def counted(n: int, word: str, words: str | None = None) -> str:
    """`1 entry`, `2 entries`."""
    return f"{n} {word if n == 1 else words or word + 's'}"


def _root(cache_dir: str | None) -> Path:
    from .cache import default_root

    return Path(cache_dir) if cache_dir else default_root()


@click.group(invoke_without_command=True)
@click.option("--cache", "cache_dir", default=None, metavar="DIR", help=CACHE_HELP)
@click.option("--entries", "each", is_flag=True, help="Also list every entry: its size and what needs it.")
@click.pass_context
def cache(ctx, cache_dir, each):
    """What the stage cache holds: entries and bytes per stage kind, and which entries the last runs of each output
    directory, its published packages and running runs need. `quantpipe cache prune` removes the rest."""
    ctx.ensure_object(dict)["cache"] = cache_dir
    if ctx.invoked_subcommand is not None:
        return
    try:
        s = survey(_root(cache_dir), DEFAULT_KEEP_RUNS)
    except PruneError as e:
        raise BadInput(str(e)) from None
    rows = {}
    for e in s.entries:
        r = rows.setdefault(e.kind, [0, 0, 0])
        r[0], r[1], r[2] = r[0] + 1, r[1] + e.bytes, r[2] + bool(e.needed_by)
    total = [sum(r[i] for r in rows.values()) for i in range(3)]
    click.echo(f"stage cache {s.root} (files linked from several entries counted once)")
    click.echo(f"  {'kind':<10} {'entries':>7} {'size':>10} {'needed':>7}")
    for kind, (n, size, needed) in [*sorted(rows.items()), ("total", total)]:
        click.echo(f"  {kind:<10} {n:>7} {human_bytes(size):>10} {needed:>7}")
    click.echo(
        f"needed: by the last {counted(s.keep_runs, 'run')} of each of {counted(len(s.output_dirs), 'output directory', 'output directories')} "
        f"({counted(s.runs, 'run')} recorded), {counted(s.packages, 'published package')} and "
        f"{counted(len(s.running), 'running run')}"
    )
    if s.gone:
        click.echo(f"output directories gone (their runs keep nothing): {', '.join(s.gone)}")
    for e in s.entries if each else []:
        click.echo(
            f"  {e.stage:<24} {e.key[:16]}  {human_bytes(e.bytes):>10}  {'; '.join(e.needed_by) or 'not needed'}"
        )
    if s.runs == 0 and s.entries:
        click.echo("no run has recorded itself in runs.jsonl: prune refuses until one has (run your recipes once)")
        return
    click.echo(
        f"`quantpipe cache prune --keep-runs {s.keep_runs}` would remove {counted(len(s.unneeded), 'entry', 'entries')} "
        f"and free {human_bytes(s.reclaimable_bytes())}"
    )


@cache.command()
@click.option(
    "--keep-runs",
    type=int,
    default=DEFAULT_KEEP_RUNS,
    show_default=True,
    metavar="N",
    help="Keep the entries of the last N runs of each output directory that used the cache.",
)
@click.option("--cache", "cache_dir", default=None, metavar="DIR", help=CACHE_HELP)
@click.option("--dry-run", is_flag=True, help="Say what would be removed and freed; remove nothing.")
@click.pass_context
def prune(ctx, keep_runs, cache_dir, dry_run):
    """Remove the cache entries that no kept run, published package (packages/<artifact> of an output directory)
    or running run needs. Entries whose lock another process holds (a run building them) are skipped and named."""
    try:
        p = prune_cache(_root(cache_dir or ctx.obj.get("cache")), keep_runs, dry_run=dry_run)
    except PruneError as e:
        raise BadInput(str(e)) from None
    kinds = Counter(e.kind for e in p.removed)
    by_kind = f" ({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))})" if kinds else ""
    kept = [e for e in p.survey.entries if e.needed_by]
    verb = "would remove" if dry_run else "removed"
    freed = "would free" if dry_run else "freed"
    click.echo(
        f"{p.survey.root}: {verb} {counted(len(p.removed), 'entry', 'entries')}{by_kind}, {freed} "
        f"{human_bytes(p.freed_bytes)}; kept {counted(len(kept), 'entry', 'entries')}, needed by the last "
        f"{counted(keep_runs, 'run')} of {counted(len(p.survey.output_dirs), 'output directory', 'output directories')}, "
        f"{counted(p.survey.packages, 'published package')} and {counted(len(p.survey.running), 'running run')}"
    )
    for e in p.locked:
        click.echo(f"skipped {e.stage} {e.key[:16]}: another process holds its lock (a run building it)")
    if dry_run:
        click.echo("nothing was removed (--dry-run)")
