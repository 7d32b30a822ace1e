"""Writing report.html (self-contained), report.md and report.json for a run."""

from __future__ import annotations

import base64
import functools
import json
import re
from pathlib import Path

from ..common.fmt import fmt, human_bytes, md_cell, md_code
from ..run.record import RunRecord
from .decide import sig
from .plots import make_plots
from .records import TEMPLATES
from .summary import summarize


@functools.lru_cache(maxsize=2)  # one per process: the templates compile once (Jinja reloads one that changed)
def _env(autoescape: bool):
    import jinja2
    import markupsafe

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        autoescape=autoescape,
        undefined=jinja2.ChainableUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["fmt"] = fmt
    env.filters["bytes"] = human_bytes
    env.filters["md"] = md_cell
    env.filters["mdcode"] = md_code
    env.filters["sig"] = sig
    # `name` in a sentence -> <code>name</code>, after escaping everything else
    env.filters["code"] = lambda v: markupsafe.Markup(
        re.sub(r"`([^`]+)`", r"<code>\1</code>", str(markupsafe.escape(v)))
    )
    return env


def write_report(record: RunRecord | dict, run_dir: Path, out_dir: Path) -> list[Path]:
    """Write report.html, report.md, report.json (and plots/*.png) into run_dir; return their paths."""
    run_dir = Path(run_dir)
    summary = summarize(record)
    plots = make_plots(summary, run_dir / "plots")
    for p in plots:
        p["data_uri"] = "data:image/png;base64," + base64.b64encode(Path(p["path"]).read_bytes()).decode()
    ctx = {"s": summary, "plots": plots, "out_dir": str(out_dir)}
    html = _env(True).get_template("report.html.j2").render(**ctx)
    md = _env(False).get_template("report.md.j2").render(**ctx)
    paths = [run_dir / "report.html", run_dir / "report.md", run_dir / "report.json"]
    _atomic_write(paths[0], html)
    _atomic_write(paths[1], md)
    data = {**summary, "plots": [{k: v for k, v in p.items() if k != "data_uri"} for p in plots]}
    _atomic_write(paths[2], json.dumps(data, indent=2, default=str) + "\n")
    return paths + [Path(p["path"]) for p in plots]


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
