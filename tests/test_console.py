"""The run's console: the live line a running stage gets (fed by the runner's process pump and the benchmark's own
logs) and the decision printed when the run ends, through CliRunner and through a real `quantpipe run` on a
pseudo-terminal; --quiet and non-terminal output stay plain.

    .venv/quantize/bin/python -m pytest tests/test_console.py -m "slow or not slow"
"""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest
import yaml

from quantpipe.console import HEADERS, LiveStatus, doing, final_summary
from quantpipe.run.process import Processes

REPO = Path(__file__).resolve().parents[1]
HELPERS = REPO / "tests" / "helpers"
QP = REPO / ".venv" / "quantize" / "bin" / "quantpipe"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _live(spec: dict, tmp: Path) -> tuple[LiveStatus, Path]:
    from rich.console import Console

    live = LiveStatus(Console(file=io.StringIO(), width=140))
    (tmp / "spec.json").write_text(json.dumps(spec))
    log = tmp / "stage.log"
    live.begin(log, ["python", "worker.py", str(tmp / "spec.json")])
    return live, log


# --- the live line ----------------------------------------------------------------------------------


def test_the_pump_feeds_progress_bars_to_the_live_line_as_they_move(tmp_path):
    """A bar redrawn with \\r reaches the live line before its line ends; the log keeps every byte."""
    live, log = _live({"stage": "quantize:gptq", "kind": "quantize", "out": str(tmp_path / "out")}, tmp_path)
    procs = Processes(tmp_path / "tmp", [])
    procs.watch = live
    seen, done = [], threading.Event()
    t = threading.Thread(
        target=lambda: (
            procs.spawn([sys.executable, str(HELPERS / "progress_bar.py"), str(tmp_path / "spec.json")], log, 30),
            done.set(),
        )
    )
    t.start()
    while not done.is_set():
        seen += [x[2] for x in live.lines()]
        time.sleep(0.1)
    t.join()
    # while the program ran (its bar still open, with no newline) the line named the layer and the samples done
    assert "model.layers.1.self_attn.v_proj · calibrating subgraph 3/5: 4/64 samples" in seen
    assert "model.layers.1.self_attn.v_proj · calibrating subgraph 3/5: 20/64 samples" in seen
    text = log.read_bytes().decode()  # (read_text would turn each \r into \n)
    assert text.endswith(
        "| 4/64 [00:08<00:17,  2.56it/s]\r(3/5): Calibrating:  31%|###       | 20/64 [00:08<00:17,  2.56it/s]\r\n"
    )
    assert live.lines() == []  # the stage ended: its line is gone


def test_the_benchmark_line_says_server_starting_then_requests_sent(tmp_path):
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    spec = {
        "stage": "benchmark:fp8",
        "kind": "benchmark",
        "out": str(out),
        "input": {"benchmark": {"variants": [{"name": "eager-x"}], "server_starts": 2}},
    }
    live, log = _live(spec, tmp_path)
    st = live._stages[str(log)]
    server = out / "logs" / "server-default.log"
    server.write_text("(APIServer pid=1) INFO 12-01 21:40:46 [utils.py:1] vLLM API server version 0.32.0\n")
    t0 = time.time()
    assert doing(st, t0) == "server default starting (0 s)"
    assert doing(st, t0 + 32) == "server default starting (32 s)"
    with open(server, "a") as f:
        f.write(
            "INFO:     Application startup complete.\n"
            + 'INFO:     127.0.0.1:1 - "POST /v1/completions HTTP/1.1" 200 OK\n' * 2
        )
    assert doing(st, t0 + 40) == "server default up; warming up"
    bench = out / "logs" / "bench-default-fixed-512-128-c16.log"
    bench.write_text(
        "$ python -m vllm.entrypoints.cli.main bench serve --dataset-name random --num-prompts 64 --max-concurrency 16\n"
    )
    assert doing(st, t0 + 50) == "fixed-512-128 c=16: 0/64 requests sent"  # the warm-up's requests are not counted
    with open(server, "a") as f:
        f.write(
            'INFO:     127.0.0.1:2 - "POST /v1/completions HTTP/1.1" 200 OK\n' * 40
            + 'INFO:     127.0.0.1:3 - "GET /metrics HTTP/1.1" 200 OK\n'
        )
    assert doing(st, t0 + 60) == "fixed-512-128 c=16: 40/64 requests sent"
    # the point's second run (the benchmark repeats a point until its intervals are tight): counted from its own start
    (out / "logs" / "bench-default-fixed-512-128-c16-r1.log").write_text("$ vllm bench serve --num-prompts 64\n")
    assert doing(st, t0 + 62) == "fixed-512-128 c=16, run 2: 0/64 requests sent"
    with open(server, "a") as f:
        f.write('INFO:     127.0.0.1:2 - "POST /v1/completions HTTP/1.1" 200 OK\n' * 5)
    assert doing(st, t0 + 65) == "fixed-512-128 c=16, run 2: 5/64 requests sent"
    # a second engine variant: its own server, named; its client runs counted from its own start
    (out / "logs" / "server-eager-x.log").write_text("INFO:     Application startup complete.\n")
    time.sleep(0.01)
    (out / "logs" / "bench-eager-x-fixed-512-128-c4-r0.log").write_text("$ vllm bench serve --num-prompts 8\n")
    assert doing(st, t0 + 70) == "eager-x: fixed-512-128 c=4: 0/8 requests sent"
    (out / "logs" / "bench-eager-x-fixed-512-128-r2.5-r0.log").write_text(
        "$ vllm bench serve --num-prompts 8 --request-rate 2.5\n"
    )
    assert doing(st, t0 + 80) == "eager-x: fixed-512-128 r=2.5/s: 0/8 requests sent"
    # the default engine's second server start (benchmark.server_starts): its own server and runs, named so
    (out / "logs" / "server-default-start2.log").write_text("vLLM API server version 0.32.0\n")
    assert doing(st, t0 + 90) == "server default (start 2) starting (0 s)"
    with open(out / "logs" / "server-default-start2.log", "a") as f:
        f.write("INFO:     Application startup complete.\n")
    time.sleep(0.01)
    (out / "logs" / "bench-default-start2-fixed-512-128-c4.log").write_text("$ vllm bench serve --num-prompts 8\n")
    assert doing(st, t0 + 95) == "default (start 2): fixed-512-128 c=4: 0/8 requests sent"


def test_evaluate_line_names_the_tasks_and_lm_evals_progress(tmp_path):
    live, log = _live(
        {
            "stage": "evaluate:fp8",
            "kind": "evaluate",
            "input": {"lm_eval": {"tasks": ["tiny_facts_mc", "tiny_recall_gen"]}},
        },
        tmp_path,
    )
    st = live._stages[str(log)]
    assert doing(st, 0) == "starting: importing its libraries"
    live.line(log, "Running loglikelihood requests:  48%|████▊     | 215/448 [00:00<00:00, 607.80it/s]\r")
    assert doing(st, 0) == "lm-eval tiny_facts_mc, tiny_recall_gen: loglikelihood 215/448 requests"
    live.line(log, "Loading weights: 100%|██████████| 39/39 [00:00<00:00, 5954.78it/s]\n")
    assert doing(st, 0) == "validation set and fidelity vs the baseline"


SUMMARY = {
    "rows": [
        {
            "artifact": "baseline",
            "baseline": True,
            "size_bytes": 10 * 2**20,
            "recovery": 1.0,
            "recovery_ci": None,
            "kl_mean": None,
            "goodput": 55.5,
            "best": {"concurrency": 4},
            "servable": True,
            "gate": "—",
            "failed_stages": [],
        },
        {
            "artifact": "int8",
            "baseline": False,
            "size_bytes": 6 * 2**20,
            "recovery": 1.0,
            "recovery_ci": [0.978, 1.031],
            "kl_mean": 0.00056,
            "goodput": 30.2,
            "goodput_ci": [28.1, 32.4],
            "best": {"concurrency": 4},
            "servable": True,
            "gate": "PASS",
            "failed_stages": [],
        },
        {
            "artifact": "awq",
            "baseline": False,
            "size_bytes": 4 * 2**20,
            "recovery": 0.93,
            "recovery_ci": [0.9, 0.96],
            "kl_mean": 0.0102,
            "goodput": None,
            "best": None,
            "servable": False,
            "gate": "FAIL",
            "failed_stages": [],
        },
    ],
    "recommendation": {
        "choice": "int8",
        "sentence": "Recommended: `int8`: it passes every gate and serves the most requests within the SLO.",
    },
}


def test_final_summary_plain_and_on_a_terminal(tmp_path):
    from rich.console import Console

    plain = io.StringIO()
    final_summary(Console(file=plain, width=120), SUMMARY, tmp_path / "report.html", plain=True)
    lines = plain.getvalue().splitlines()
    assert lines[0].split() == " ".join(HEADERS).split() and "\x1b" not in plain.getvalue()
    assert lines[2].split() == [
        "int8",
        "★",
        "6.0",
        "MiB",
        "1.000",
        "[0.978,",
        "1.031]",
        "0.00056",
        "30.2",
        "[28.1,",
        "32.4]",
        "req/s",
        "(c=4)",
        "PASS",
    ]
    assert lines[3].split() == [
        "awq",
        "4.0",
        "MiB",
        "0.930",
        "[0.900,",
        "0.960]",
        "0.01",
        "not",
        "servable",
        "here",
        "FAIL",
    ]
    assert lines[-2] == "Recommended: int8: it passes every gate and serves the most requests within the SLO."
    assert lines[-1] == f"report: {tmp_path / 'report.html'}"
    tty = io.StringIO()
    final_summary(Console(file=tty, width=120, force_terminal=True), SUMMARY, None, plain=False)
    assert "\x1b[" in tty.getvalue() and "Recommended:" in ANSI.sub("", tty.getvalue())


# --- real runs ----------------------------------------------------------------------------------------


def tiny_recipe(path: Path, tiny, cache: Path, out: Path, **over) -> Path:
    """The tiny Llama with its adapter, FP8 and 4-bit RTN, lm-eval on one local task and the validation set, no benchmark."""
    d = {
        "name": "console",
        "output_dir": str(out),
        "cache_dir": str(cache),
        "base": {"model": str(tiny.llama)},
        "adapters": [{"path": str(tiny.llama_lora)}],
        "artifacts": [{"name": "fp8", "method": "fp8"}, {"name": "rtn", "method": "rtn", "bits": 4, "group_size": 128}],
        "evaluation": {
            "lm_eval": {"tasks": [tiny.task_names[0]], "include_path": str(tiny.tasks), "limit": 48, "batch_size": 16},
            "validation": {"path": str(tiny.validation), "metric": "exact_match", "max_new_tokens": 8},
            "gates": {"min_recovery": 0.5, "max_kl": 0.5},
        },
        "benchmark": {"enabled": False},
    }
    d.update(over)
    path.write_text(yaml.safe_dump(d))
    return path


def shared_cache(tmp_path_factory) -> Path:
    """One stage cache for the session's tiny runs (test_history reuses it): built once, then every stage is a hit."""
    return tmp_path_factory.getbasetemp() / "tiny-run-cache"


@pytest.fixture(scope="module")
def cli_run(tiny, tmp_path_factory):
    from click.testing import CliRunner

    from quantpipe.cli import main

    tmp = tmp_path_factory.mktemp("console")
    recipe = tiny_recipe(tmp / "r.yaml", tiny, shared_cache(tmp_path_factory), tmp / "out")
    result = CliRunner().invoke(main, ["run", str(recipe)])
    return recipe, result


@pytest.mark.slow
def test_cli_run_ends_with_the_table_and_the_recommendation(cli_run):
    recipe, result = cli_run
    assert result.exit_code == 0, result.output
    out = result.output
    assert "\x1b[" not in out  # not a terminal: plain
    lines = out.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.split() == " ".join(HEADERS).split())
    rows = [ln.split()[0] for ln in lines[head + 1 : head + 4]]
    assert rows == ["baseline", "fp8", "rtn"]
    assert all(ln.split()[-1] == "PASS" for ln in lines[head + 2 : head + 4])
    sentence = lines[head + 5]
    assert sentence.startswith("Recommended: ") and sentence.endswith(".") and sentence.count(". ") == 0
    run_dir = Path(
        json.loads(
            (Path(yaml.safe_load(recipe.read_text())["output_dir"]) / "runs" / "index.jsonl")
            .read_text()
            .splitlines()[-1]
        )["run_dir"]
    )
    assert lines[head + 6] == f"report: {run_dir / 'report.html'}"
    assert lines[-1] == lines[head + 6]  # where the report is: the run's last line
    assert json.loads((run_dir / "report.json").read_text())["recommendation"]["sentence"].replace("`", "") == sentence
    assert not re.search(r"^\s*\w+\s+gate (PASS|FAIL)", out, re.M)  # the per-artifact gate lines gave way to the table


def _pty_run(args: list[str], cwd: Path, timeout: float = 1500) -> tuple[int, str]:
    """`quantpipe ARGS` on a pseudo-terminal (140 columns), as a user at a terminal runs it; (exit code, what it printed)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 140, 0, 0))
    p = subprocess.Popen(
        [str(QP), *args], stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env={**os.environ, "TERM": "xterm-256color"}
    )
    os.close(slave)
    out, deadline = b"", time.time() + timeout
    while time.time() < deadline:
        ready, _, _ = select.select([master], [], [], 1)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif p.poll() is not None:
            break
    p.wait(timeout=60)
    os.close(master)
    return p.returncode, out.decode("utf-8", "replace")


@pytest.mark.slow
def test_a_run_on_a_terminal_shows_live_lines_then_the_decision(cli_run, tmp_path):
    recipe, first = cli_run
    assert first.exit_code == 0, first.output
    rc, out = _pty_run(["run", str(recipe), "--force", "evaluate:rtn"], tmp_path)
    assert rc == 0, out[-3000:]
    text = ANSI.sub("", out)
    frames = [seg.strip() for seg in re.split(r"[\r\n]", text) if seg.strip()]
    # the live line of the evaluate stage: a spinner, its id, its elapsed time, lm-eval's task and progress
    live = [
        f
        for f in frames
        if re.match(
            r"^\S\s+evaluate:rtn\s+\d+(m\d\ds|s)\s+lm-eval tiny_\w+: (loglikelihood|generate_until) \d+/\d+ requests$",
            f,
        )
    ]
    assert live, "\n".join(frames[-60:])
    assert re.search(r"\x1b\[1martifact", out)  # the table's header in bold: rich on a terminal
    assert "Recommended: " in text and "report: " in frames[-1]
    # --quiet on the same terminal: no control codes at all, the same decision in plain lines
    rc, quiet = _pty_run(["run", str(recipe), "--quiet"], tmp_path)
    assert rc == 0 and "\x1b" not in quiet, quiet[-2000:]
    assert any(ln.split() == " ".join(HEADERS).split() for ln in quiet.splitlines())
    assert "Recommended: " in quiet and "running" not in quiet.splitlines()[-1]
