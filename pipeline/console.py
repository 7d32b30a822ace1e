"""The run's console: a live line per running stage while it runs, the decision when it ends.

On a terminal, `LiveStatus` (a rich Live display) shows each running stage's elapsed time and what it is doing, read from
the log lines the runner's process pump hands it and from the benchmark's own logs (`server default starting (32 s)`,
`fixed c=16: 40/64 requests sent`, counted in the server's access log). The logs keep everything; the live lines vanish
when their stage ends. `final_summary` prints the artifacts, the recommendation and where the report is, as plain text
when the console is not a terminal or with --quiet (CI logs).

    with LiveStatus(console) as live:
        runner.procs.watch = live
        runner.run(...)
    final_summary(console, summarize(record), run_dir / "report.html", plain=not console.is_terminal)
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .common.fmt import human_bytes
from .recipe.benchmark import start_names, start_number
from .report.decide import sig

TQDM = re.compile(r"(?P<desc>[^\r\n|%]*?)[:\s]*(?P<pct>\d{1,3})%\|[^|]{0,80}\|\s*(?P<n>\d+)/(?P<total>\d+)")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
LAYER = re.compile(r"\b(model\.layers\.\d+(?:\.[A-Za-z_]\w*)*)")
CALIBRATING = re.compile(r"\((\d+)/(\d+)\): (Calibrating|Propagating)")
SERVER_UP = ("Application startup complete", "Starting vLLM server on", "Started server process")
REQUEST = re.compile(r'"POST /v1/(?:chat/)?completions HTTP')
NUM_PROMPTS = re.compile(r"--num-prompts[ =](\d+)")
NOISE = re.compile(r"^(W\d{4} |WARNING|warnings\.warn|\s*$|\$ )")  # lines that do not say what a stage is doing


@dataclass
class _File:
    """A log the console follows from where it last read."""

    path: Path
    first_seen: float
    offset: int = 0
    up: bool = False
    requests: int = 0  # server logs: requests the access log showed since `mark`
    mark: int = 0


@dataclass
class _Stage:
    id: str
    kind: str
    out: Path | None
    spec: dict
    t0: float
    spinner: object = None
    progress: str = ""  # the last tqdm bar of its output
    last: str = ""  # its last other line that says something
    layer: str = ""
    files: dict = field(default_factory=dict)
    bench: str | None = None  # the client log being followed
    lm_eval_seen: bool = False


class LiveStatus:
    """The live lines: `Processes.watch` calls begin/line/end from the stages' threads; rich's Live renders `__rich__`."""

    def __init__(self, console, refresh_per_second: float = 4):
        self.console = console
        self.refresh = refresh_per_second
        self._stages: dict[str, _Stage] = {}
        self._lock = threading.Lock()
        self._live = None

    def __enter__(self):
        from rich.live import Live

        self._live = Live(
            self,
            console=self.console,
            refresh_per_second=self.refresh,
            transient=True,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self._live.start()
        return self

    def __exit__(self, *exc):
        if self._live is not None:
            self._live.stop()
            self._live = None
        return False

    # --- the hooks --------------------------------------------------------------------------
    def begin(self, log_path: Path, cmd: list[str]) -> None:
        spec = _spec(cmd)
        from rich.spinner import Spinner

        st = _Stage(
            id=spec.get("stage") or Path(log_path).stem,
            kind=spec.get("kind") or Path(log_path).stem.split("_")[0],
            out=Path(spec["out"]) if spec.get("out") else None,
            spec=spec,
            t0=time.time(),
            spinner=Spinner("dots", style="cyan"),
        )
        with self._lock:
            self._stages[str(log_path)] = st

    def line(self, log_path: Path, text: str) -> None:
        st = self._stages.get(str(log_path))
        if st is None:
            return
        text = ANSI.sub("", text[-4000:]).strip()  # a bar is short; a 100 kB log line must not cost the pump its pace
        bar = text.rfind("%|")  # the last bar of the line, matched around its "NN%|" only
        m = TQDM.search(text[max(0, bar - 160) : bar + 200]) if bar >= 0 else None
        if m is not None:
            st.progress = f"{m['desc'].strip() or 'progress'} {m['n']}/{m['total']}"
            layer = LAYER.search(m["desc"])
            if layer:
                st.layer = layer.group(1)
            return
        if NOISE.match(text):
            return
        layer = LAYER.search(text)
        if layer:
            st.layer = layer.group(1)
        st.last = text

    def end(self, log_path: Path) -> None:
        with self._lock:
            self._stages.pop(str(log_path), None)

    # --- what a stage is doing --------------------------------------------------------------
    def lines(self, now: float | None = None) -> list[tuple[str, str, str]]:
        """(stage id, elapsed, what it is doing) per running stage."""
        now = time.time() if now is None else now
        with self._lock:
            stages = list(self._stages.values())
        return [(st.id, _elapsed(now - st.t0), doing(st, now)) for st in stages]

    def __rich__(self):
        from rich.table import Table
        from rich.text import Text

        grid = Table.grid(padding=(0, 1))
        now = time.time()
        with self._lock:
            stages = list(self._stages.values())
        width = max(20, (self.console.width or 100) - 45)
        for st in stages:
            what = doing(st, now)
            grid.add_row(
                st.spinner,
                Text(f"{st.id:<22}", style="bold"),
                Text(f"{_elapsed(now - st.t0):>6}"),
                Text(what if len(what) <= width else what[: width - 1] + "…"),
            )
        return grid


def doing(st: _Stage, now: float) -> str:
    if st.kind == "benchmark" and st.out is not None:
        text = _benchmark(st, now)
        if text:
            return text
    if st.kind == "quantize" and (st.layer or st.progress):
        cal = CALIBRATING.match(st.progress)
        what = st.progress
        if cal:  # llm-compressor's sequential pipeline: "(3/5): Calibrating 36/64" -> subgraph 3 of 5, 36 of 64 samples
            what = f"{cal.group(3).lower()} subgraph {cal.group(1)}/{cal.group(2)}: {st.progress.rsplit(' ', 1)[-1]} samples"
        elif st.layer and st.layer in what:
            what = what.replace(st.layer, "").replace(" for ", " ").strip()
        return " · ".join(" ".join(x.split()) for x in (st.layer, what) if x)
    if st.kind == "evaluate" and st.progress:
        p = st.progress.replace("Running ", "").replace(" requests", "")
        tasks = ", ".join(((st.spec.get("input") or {}).get("lm_eval") or {}).get("tasks") or [])
        if "loglikelihood" in p or "generate" in p:
            st.lm_eval_seen = True
            return f"lm-eval {tasks + ': ' if tasks else ''}{p} requests"
        if (
            st.lm_eval_seen
        ):  # after lm-eval the stage scores the validation set and the fidelity figures (no bars of their own)
            return "validation set and fidelity vs the baseline"
        return p
    return st.progress or (st.last[:120] if st.last else "starting: importing its libraries")


def _benchmark(st: _Stage, now: float) -> str | None:
    """The benchmark's phase from its work folder: a server starting, warming up, or a client run and its requests."""
    logs = st.out / "logs"
    try:
        found = sorted(logs.glob("*.log"), key=lambda p: p.stat().st_mtime)
    except OSError:
        return None
    for p in found:
        if str(p) not in st.files:
            st.files[str(p)] = _File(p, now)
    servers = [st.files[str(p)] for p in found if p.name.startswith("server-")]
    if not servers:
        return None
    srv = max(servers, key=lambda f: f.first_seen)
    _follow(srv)
    name = _variant(srv.path.stem.removeprefix("server-"))
    if not srv.up:
        return f"server {name} starting ({now - srv.first_seen:.0f} s)"
    benches = [
        st.files[str(p)] for p in found if p.name.startswith("bench-") and st.files[str(p)].first_seen >= srv.first_seen
    ]
    if not benches:
        return f"server {name} up; warming up"
    bench = max(benches, key=lambda f: (f.first_seen, f.path.stat().st_mtime if f.path.exists() else 0))
    if st.bench != str(bench.path):  # a new client run: count the server's requests from here
        st.bench, srv.mark = str(bench.path), srv.requests
    head = _head(bench.path)
    total = NUM_PROMPTS.search(head)
    label = _bench_label(bench.path.stem.removeprefix("bench-"), st.spec)
    sent = srv.requests - srv.mark
    if total:
        return f"{label}: {min(sent, int(total.group(1)))}/{total.group(1)} requests sent"
    return f"{label}: {sent} requests sent"


def _variant(name: str) -> str:
    """A variant as the line names it: 'default-start2' (`benchmark.server_starts`) -> 'default (start 2)'."""
    k = start_number(name)
    return name if k is None else f"default (start {k})"


def _bench_label(stem: str, spec: dict) -> str:
    """'default-fixed-c16-r1' -> 'fixed c=16, run 2', splitting on the recipe's variant names (the default one unnamed;
    'default-start2-fixed-c4' -> 'default (start 2): fixed c=4')."""
    bench = (spec.get("input") or {}).get("benchmark") or {}
    variants = ["default", *[v.get("name") for v in bench.get("variants") or [] if isinstance(v, dict)], "lora"]
    starts = bench.get("server_starts")
    variants += start_names(starts) if isinstance(starts, int) else []
    m = re.match(r"^(?P<rest>.+?)-(?:c(?P<c>\d+)|r(?P<rate>\d+(?:\.\d+)?))(?:-r(?P<run>\d+))?$", stem)
    if not m:
        return stem
    load = f"c={m['c']}" if m["c"] else f"r={m['rate']}/s"
    run = f", run {int(m['run']) + 1}" if m["run"] is not None and int(m["run"]) > 0 else ""
    rest = m["rest"]
    for v in sorted(variants, key=len, reverse=True):
        if rest.startswith(f"{v}-"):
            return f"{'' if v == 'default' else _variant(v) + ': '}{rest[len(v) + 1 :]} {load}{run}"
    return f"{rest} {load}{run}"


def _follow(f: _File) -> None:
    """Read what a server log gained since last time: has it come up, how many requests has it logged."""
    try:
        with open(f.path, "rb") as fh:
            fh.seek(f.offset)
            chunk = fh.read(4 << 20)
    except OSError:
        return
    cut = chunk.rfind(b"\n") + 1  # whole lines only: a partial line waits for the next read
    text = chunk[:cut].decode("utf-8", "replace")
    f.offset += cut
    f.up = f.up or any(s in text for s in SERVER_UP)
    f.requests += len(REQUEST.findall(text))


def _head(path: Path) -> str:
    try:
        with open(path, "rb") as fh:
            return fh.read(8192).decode("utf-8", "replace")
    except OSError:
        return ""


def _spec(cmd: list[str]) -> dict:
    """The stage's spec.json (the worker's last argument): stage id, kind, input, output folder."""
    try:
        path = Path(cmd[-1])
        return json.loads(path.read_text()) if path.name == "spec.json" else {}
    except (OSError, ValueError, IndexError):
        return {}


def _elapsed(s: float) -> str:
    s = max(0, int(s))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


# --- the end of a run -----------------------------------------------------------------------------


def summary_rows(summary: dict) -> list[list[str]]:
    """The final table: artifact, size, recovery [95% CI], KL [95% CI], goodput at the SLO [95% CI], gate."""
    rows = []
    for r in summary.get("rows") or []:
        ci = r.get("recovery_ci")
        rec = (
            "—"
            if r.get("recovery") is None
            else f"{r['recovery']:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
        )
        gci = r.get("goodput_ci")
        good = (
            "—"
            if r.get("goodput") is None
            else f"{sig(r['goodput'])}"
            + (f" [{sig(gci[0])}, {sig(gci[1])}]" if gci else "")
            + " req/s"
            + (f" (c={r['best']['concurrency']})" if (r.get("best") or {}).get("concurrency") is not None else "")
        )
        if r.get("goodput") is None and r.get("servable") is False:
            good = "not servable here"
        gate = r.get("gate") or "—"
        if r.get("failed_stages"):
            gate = f"{gate}; {', '.join(r['failed_stages'])}"
        name = r["artifact"] + (" ★" if (summary.get("recommendation") or {}).get("choice") == r["artifact"] else "")
        kci = r.get("kl_ci")
        kl = (
            "0"
            if r.get("baseline")
            else sig(r.get("kl_mean"), 2)
            + (f" [{sig(kci[0], 2)}, {sig(kci[1], 2)}]" if kci and r.get("kl_mean") is not None else "")
        )
        rows.append([name, human_bytes(r.get("size_bytes")), rec, kl, good, gate])
    return rows


HEADERS = ["artifact", "size", "recovery [95% CI]", "KL [95% CI]", "goodput at SLO", "gate"]


def final_summary(console, summary: dict, report: Path | None, plain: bool) -> None:
    """Print the decision: the artifacts table, the recommendation sentence, where the report is."""
    rows = summary_rows(summary)
    sentence = (summary.get("recommendation") or {}).get("sentence") or ""
    if plain:
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(HEADERS)]
        out = ["  ".join(h.ljust(w) for h, w in zip(HEADERS, widths)).rstrip()]
        out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        out += ["", sentence.replace("`", "")]
        if report:
            out.append(f"report: {report}")
        console.print("\n".join(out), markup=False, highlight=False, soft_wrap=True)
        return
    from rich.markup import escape
    from rich.table import Table

    t = Table(box=None, header_style="bold", pad_edge=False)
    for h in HEADERS:
        t.add_column(h, no_wrap=h != "gate", justify="right" if h in ("size", "KL [95% CI]") else "left")
    colour = {"PASS": "green", "FAIL": "red"}
    for r in rows:
        gate = r[5]
        c = colour.get(gate.split(";")[0])
        t.add_row(*(escape(x) for x in r[:5]), f"[{c}]{escape(gate)}[/{c}]" if c else escape(gate))
    console.print(t)
    style = "green" if (summary.get("recommendation") or {}).get("choice") else "red"
    console.print(
        f"[{style}]" + re.sub(r"`([^`]+)`", r"[bold]\1[/bold]", escape(sentence)) + f"[/{style}]", highlight=False
    )
    if report:
        console.print(f"report: {escape(str(report))}", highlight=False)
