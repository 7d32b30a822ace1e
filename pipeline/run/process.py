"""Running a stage's worker: its own process group, its log (secrets redacted), its time limit, its signals. A stage
past its limit gets SIGTERM, then SIGKILL after 15 s, with anything left in its group; the worker ends its group
itself when the runner dies (PR_SET_PDEATHSIG in pipeline/worker.py)."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

SECRET_ENV = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL)", re.I)


def secrets() -> list[str]:
    return [v for k, v in os.environ.items() if SECRET_ENV.search(k) and len(v) >= 6]


def redact(text: str, values: list[str] | None = None) -> str:
    for v in values if values is not None else secrets():
        text = text.replace(v, "***")
    return text


class RedactFilter(logging.Filter):
    def __init__(self, values):
        super().__init__()
        self.values = values

    def filter(self, record):
        record.msg = redact(record.getMessage(), self.values)
        record.args = None
        return True


def _wait(p: subprocess.Popen, timeout_s: float | None, paused=None, poll_s: float = 1.0) -> bool:
    """Wait for `p`; False when it has run `timeout_s` seconds, not counting the polls at which `paused()` held."""
    if timeout_s is None:
        p.wait()
        return True
    used, last = 0.0, time.monotonic()
    while used < timeout_s:
        try:
            p.wait(timeout=min(poll_s, timeout_s - used))
            return True
        except subprocess.TimeoutExpired:
            now = time.monotonic()
            if paused is None or not paused():
                used += now - last
            last = now
    return False


class Processes:
    """The stage workers a run has started, so that a signal or the run's end can stop every one of them."""

    def __init__(self, tmpdir: Path, secret_values: list[str], verbose: bool = False):
        self.tmpdir = tmpdir
        self.secret_values = secret_values
        self.verbose = verbose
        self.children: set[subprocess.Popen] = set()
        self.stopping = False  # set by stop_all: a stage that ends now was stopped, it did not fail
        self.watch = None  # the console's live status (quantpipe.console.LiveStatus): begin/line/end per stage log

    def spawn(
        self, cmd: list[str], log_path: Path, timeout_s: float | None, extra_env: dict | None = None, paused=None
    ) -> int | None:
        """Exit code, or None past `timeout_s`, not counting time while `paused()` holds (a queued benchmark)."""
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "QUANTPIPE_RUNNER_PID": str(os.getpid()),
            **(extra_env or {}),
        }
        env.setdefault("TMPDIR", str(self.tmpdir))
        Path(env["TMPDIR"]).mkdir(parents=True, exist_ok=True)
        with open(log_path, "w") as logf:
            logf.write(f"$ {' '.join(cmd)}\n")
            logf.flush()
            p = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
            self.children.add(p)
            if self.watch is not None:
                self.watch.begin(log_path, cmd)
            pump = threading.Thread(target=self._pump, args=(p.stdout, logf, log_path), daemon=True)
            pump.start()
            try:
                rc = p.returncode if _wait(p, timeout_s, paused) else None
                if rc is None:  # a hung stage: SIGTERM (the worker ends its group), then SIGKILL
                    killpg(p.pid, signal.SIGTERM)
                    try:
                        p.wait(timeout=15)
                    except subprocess.TimeoutExpired:
                        pass
            finally:
                pump.join(timeout=10)
                if self.watch is not None:
                    self.watch.end(log_path)
                self.children.discard(p)
                killpg(p.pid, signal.SIGKILL)  # anything the stage left behind in its group
        return rc

    def _pump(self, stream, logf, log_path: Path | None = None) -> None:
        for raw in _segments(stream):
            line = redact(raw.decode("utf-8", "replace"), self.secret_values)
            try:
                logf.write(line)
                logf.flush()
            except (OSError, ValueError):
                pass  # the log's disk is full: keep draining, or the stage would block on a full pipe
            if self.verbose:
                sys.stderr.write(line)
            if self.watch is not None:
                self.watch.line(log_path, line)

    def signal_all(self, sig) -> None:
        for p in list(self.children):
            killpg(p.pid, sig)

    def stop_all(self) -> None:
        """SIGTERM every running stage's group, wait up to 10 s, then SIGKILL what is left."""
        self.stopping = True
        self.signal_all(signal.SIGTERM)
        deadline = time.time() + 10
        for p in list(self.children):
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
            killpg(p.pid, signal.SIGKILL)


def _segments(stream):
    """Output cut after each \\n or \\r, so a progress bar is seen as it moves; the pieces join to it byte for byte."""
    buf = b""
    read = stream.read1 if hasattr(stream, "read1") else stream.readline
    while chunk := read(65536):
        *whole, buf = re.split(rb"(?<=[\r\n])", buf + chunk)
        yield from (w for w in whole if w)
    if buf:
        yield buf


def killpg(pid: int, sig) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def exit_reason(rc: int) -> str:
    if rc >= 0:
        return f"exit code {rc}"
    try:
        name = signal.Signals(-rc).name
    except ValueError:
        name = f"signal {-rc}"
    hint = (
        " (the kernel's out-of-memory killer sends SIGKILL: check `dmesg` and the stage's memory)"
        if -rc == signal.SIGKILL
        else ""
    )
    return f"killed by {name}{hint}"


def tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""
