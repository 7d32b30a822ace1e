"""`quantpipe history`: every artifact's figures across runs, each run judged against its last good predecessor by
compare's noise-aware rule: a doctored regression is flagged, a change within the noise is not; each point links to
its run's report. On constructed records (fast) and on three real runs of a tiny recipe (slow).

    .venv/quantize/bin/python -m pytest tests/test_history.py -m "slow or not slow"
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from unittest import mock

import pytest
from click.testing import CliRunner
from test_report import CHROMIUM, _chromium, _console_errors, _png_size, make_record, save_run

from quantpipe.cli import main
from quantpipe.history import write_history
from quantpipe.report import render, write_report


def _report(rec: dict, run_dir: Path, out: Path) -> None:
    """The run's report without its plots (history reads report.json and links report.html; plots are test_report's)."""
    with mock.patch.object(render, "make_plots", lambda summary, plot_dir: []):
        write_report(rec, run_dir, out)


def _shift(record: dict, artifact: str, by: float) -> None:
    """Move the worst task's recovery of `artifact` (and its CI with it) by `by`: a doctored night."""
    rows = record["stages"][f"evaluate:{artifact}"]["metrics"]["comparison"]
    c = min(rows, key=lambda c: c["recovery"])
    c["recovery"] += by
    c["artifact"] = c["baseline"] * c["recovery"]
    if c.get("ci95"):
        c["ci95"] = [c["ci95"][0] + by, c["ci95"][1] + by]


def _nights(out: Path) -> list[Path]:
    """Three nights of make_record(): the second moves fp8's recovery within its CI, the third drops it beyond."""
    dirs = []
    for run_id, start, by in (
        ("r1", "2026-11-28T02:30:00Z", 0.0),
        ("r2", "2026-11-29T02:30:00Z", -0.015),
        ("r3", "2026-11-30T02:30:00Z", -0.09),
    ):
        rec = make_record(run_id, start, tweak=lambda r, by=by: _shift(r, "fp8", by))
        d = save_run(out, rec)
        _report(rec, d, out)
        dirs.append(d)
    return dirs


def test_history_flags_the_regression_and_not_the_noise(tmp_path):
    _nights(tmp_path)
    paths = write_history(tmp_path)
    assert paths == [tmp_path / "history.json", tmp_path / "history.html"]
    h = json.loads(paths[0].read_text())
    assert [r["run_id"] for r in h["runs"]] == ["r1", "r2", "r3"]
    assert [r["against"] for r in h["runs"]] == [None, "r1", "r2"]
    fp8 = {p["run_id"]: p for p in h["artifacts"]["fp8"]["points"]}
    assert fp8["r2"]["flags"] == [] and fp8["r2"]["recovery"] == pytest.approx(0.975)  # moved, within the ±0.0375 CI
    assert fp8["r3"]["flags"] == ["recovery"] and "beyond the CI" in fp8["r3"]["findings"][0]
    assert [x["run_id"] for x in h["regressions"]] == ["r3"]
    assert fp8["r1"]["recovery_ci"] == pytest.approx([0.95, 1.025])
    for key in ("kl_mean", "goodput", "ttft_p99_ms", "tpot_p99_ms", "size_bytes"):
        assert fp8["r3"][key] is not None, key
    assert {p["gate"] for p in h["artifacts"]["w8a8"]["points"]} == {"FAIL"} and fp8["r1"]["recommended"]


def test_history_html_links_every_point_to_its_report(tmp_path):
    _nights(tmp_path)
    html = write_history(tmp_path)[1].read_text()
    svgs = re.findall(r"<svg.*?</svg>", html, re.S)
    assert len(svgs) == 6  # recovery, KL, goodput, TTFT p99, TPOT p99, size
    recovery = svgs[0]
    for run_id in ("r1", "r2", "r3"):
        assert f'xlink:href="runs/{run_id}/report.html"' in recovery or f'href="runs/{run_id}/report.html"' in recovery
        assert (tmp_path / "runs" / run_id / "report.html").is_file()
    assert "fp8: tiny_qa/exact_match recovery 0.975 -&gt; 0.900" in html  # the finding, in the verdict box
    assert "<script" not in html and not re.search(r'(src|href)="(https?:)?//', html)


@pytest.mark.slow  # a headless browser per test
@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Chromium at /usr/bin/chromium")
def test_history_renders_in_chromium_without_horizontal_scroll(tmp_path):
    _nights(tmp_path)
    page = write_history(tmp_path)[1]
    probe = (
        "<script>window.addEventListener('load', () => { const p = document.createElement('pre'); p.id = 'probe';"
        " p.textContent = JSON.stringify({sw: document.documentElement.scrollWidth, w: window.innerWidth,"
        " svgs: [...document.querySelectorAll('svg')].map(s => Math.round(s.getBoundingClientRect().width))}); document.body.appendChild(p); });</script>"
    )
    probed = tmp_path / "probe.html"
    probed.write_text(
        page.read_text()
        .replace("default-src 'none';", "default-src 'none'; script-src 'unsafe-inline';")
        .replace("</body>", probe + "</body>")
    )
    dom = _chromium(["--window-size=1366,900", "--virtual-time-budget=5000", "--dump-dom", probed.as_uri()], tmp_path)
    info = json.loads(re.search(r'<pre id="probe">(.*?)</pre>', dom.stdout, re.S).group(1).replace("&quot;", '"'))
    assert info["sw"] <= info["w"] and len(info["svgs"]) == 6 and min(info["svgs"]) > 400, info
    shot = tmp_path / "history.png"
    res = _chromium(["--window-size=1366,1400", "--hide-scrollbars", f"--screenshot={shot}", page.as_uri()], tmp_path)
    assert _png_size(shot.read_bytes()) == (1366, 1400) and not _console_errors(res.stderr)


def test_history_cli_and_bad_input(tmp_path):
    _nights(tmp_path)
    r = CliRunner().invoke(main, ["history", str(tmp_path), "--last", "2"])
    assert r.exit_code == 0, r.output
    assert f"history: {tmp_path / 'history.html'} (2 run(s))" in r.output
    h = json.loads((tmp_path / "history.json").read_text())
    assert [x["run_id"] for x in h["runs"]] == ["r2", "r3"] and h["runs"][0][
        "against"
    ] == "r1"  # its reference is older than the window
    empty = tmp_path / "empty"
    empty.mkdir()
    r = CliRunner().invoke(main, ["history", str(empty)])
    assert r.exit_code == 2 and "no runs/ folder" in r.output and list(empty.iterdir()) == []


# --- three real runs ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_history_over_three_real_runs_of_a_tiny_recipe(tiny, tmp_path, tmp_path_factory):
    """Three runs of one recipe (the first builds, the others reuse the cache); the second night's record is doctored
    within the noise of the 4-bit artifact's CI, the third's beyond it: only the third is flagged."""
    from test_console import shared_cache, tiny_recipe

    recipe = tiny_recipe(tmp_path / "r.yaml", tiny, shared_cache(tmp_path_factory), tmp_path / "out")
    for night in range(3):
        r = CliRunner().invoke(main, ["run", str(recipe), "--quiet", *(["--history"] if night == 2 else [])])
        assert r.exit_code == 0, r.output
    assert (
        f"history: {tmp_path / 'out' / 'history.html'}" in r.output
    )  # `run --history` refreshed it after the third night
    runs = [json.loads(line) for line in (tmp_path / "out" / "runs" / "index.jsonl").read_text().splitlines()]
    assert len(runs) == 3 and len(json.loads((tmp_path / "out" / "history.json").read_text())["runs"]) == 3
    first = json.loads((Path(runs[0]["run_dir"]) / "run.json").read_text())
    worst = min(first["stages"]["evaluate:rtn"]["metrics"]["comparison"], key=lambda c: c["recovery"])
    hw = max((worst["ci95"][1] - worst["ci95"][0]) / 2, 0.01) if worst.get("ci95") else 0.05
    for i, by in ((1, -hw / 2), (2, -3 * hw)):  # night 2 within the noise, night 3 beyond it
        path = Path(runs[i]["run_dir"]) / "run.json"
        rec = json.loads(path.read_text())
        _shift(rec, "rtn", by)
        if by > -hw:  # keep night 2's interval as wide as the noise it is judged by
            c = min(rec["stages"]["evaluate:rtn"]["metrics"]["comparison"], key=lambda c: c["recovery"])
            c["ci95"] = [c["recovery"] - hw, c["recovery"] + hw]
        path.write_text(json.dumps(rec))
        write_report(rec, path.parent, tmp_path / "out")
    r = CliRunner().invoke(main, ["history", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    h = json.loads((tmp_path / "out" / "history.json").read_text())
    pts = h["artifacts"]["rtn"]["points"]
    assert [p["flags"] for p in pts] == [[], [], ["recovery"]], [p["findings"] for p in pts]
    assert [x["run_id"] for x in h["regressions"]] == [runs[2]["run_id"]]
    assert all(p["report"] == f"runs/{x['run_id']}/report.html" for p, x in zip(pts, runs))
    assert {p["kl_mean"] is not None and p["size_bytes"] > 0 for p in pts} == {True}


def test_runs_started_in_the_same_minute_are_told_apart_by_their_seconds(tmp_path):
    for run_id, start in (("a", "2026-12-02T01:43:05Z"), ("b", "2026-12-02T01:43:18Z"), ("c", "2026-12-03T02:30:00Z")):
        rec = make_record(run_id, start)
        _report(rec, save_run(tmp_path, rec), tmp_path)
    h = json.loads(write_history(tmp_path)[0].read_text())
    assert [r["label"] for r in h["runs"]] == ["12-02 01:43:05", "12-02 01:43:18", "12-03 02:30:00"]
    h = json.loads(write_history(tmp_path, last=2)[0].read_text())
    assert [r["label"] for r in h["runs"]] == ["12-02 01:43", "12-03 02:30"]
