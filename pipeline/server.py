"""vLLM's OpenAI-compatible server as a context manager, for the benchmark stage.

`Server` starts `vllm serve` (from the interpreter given, by default the running one) on 127.0.0.1 and a free port,
waits for `/health`, samples the memory of every process it started, and stops them all on leaving the `with` block, so
no engine is left holding memory or the port. Where Python gets no chance to clean up, the server stays in the caller's
process group (quantpipe's worker kills its group on SIGTERM), gets PR_SET_PDEATHSIG (SIGTERM when the starting *thread*
dies, even by kill -9: start it from the main thread), and `stop()` also finds processes re-parented to init by an
environment marker every descendant inherits. A server that exits or stops answering before it is healthy raises
`ServerDied` with the reason its log gives (e.g. vLLM's "Failed to find a kernel ...") and the log tail.

    with Server("/models/tiny", ["--max-model-len", "512"], log_path=Path("server.log")) as srv:
        print(srv.url, srv.start_s)           # http://127.0.0.1:41237  31.8
        srv.completion("Hello", max_tokens=8)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from .common.nvidia import nvidia_smi
from .ports import HOST, free_port, port_freed
from .server_output import failure_reason, parse_metrics

MARKER_ENV = "QUANTPIPE_SERVER_ID"
IPC_TMPDIR_MAX = (
    60  # longer TMPDIRs: the server gets a short one under /tmp (ipc://<TMPDIR>/<uuid4> must fit in 107 bytes)
)


class ServerDied(RuntimeError):
    """The server exited or never became healthy; `reason` is what its log says went wrong. `verdict`: the caller
    decided that the model cannot be measured here (e.g. too slow), rather than the server failing."""

    def __init__(self, reason: str, log_tail: str = "", verdict: bool = False):
        super().__init__(reason)
        self.reason, self.log_tail, self.verdict = reason, log_tail, verdict


def set_pdeathsig() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Server:
    """One `vllm serve` process tree; use as a context manager (see the module docstring)."""

    def __init__(
        self,
        model: str | Path,
        args: list[str] | tuple[str, ...] = (),
        *,
        log_path: Path,
        served_model_name: str = "model",
        python: str | Path | None = None,
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 900,
        sample_interval_s: float = 1.0,
        gpu: bool = False,
    ):
        self.model = str(model)
        self.args = list(args)
        self.log_path = Path(log_path)
        self.served_model_name = served_model_name
        self.python = str(python or sys.executable)
        self.env = env or {}
        self.startup_timeout_s = startup_timeout_s
        self.sample_interval_s = sample_interval_s
        self.gpu = gpu
        self.id = uuid.uuid4().hex
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self.start_s: float | None = None
        self.peak_rss_bytes = 0
        self.peak_gpu_bytes = 0
        self._procs: dict[int, object] = {}  # pid -> psutil.Process, everything ever seen in the tree
        self._stop_sampling = threading.Event()
        self._sampler: threading.Thread | None = None
        self._log_file = None
        self._short_tmp: str | None = None

    @classmethod
    def connect(cls, port: int, served_model_name: str, log_path: Path | None = None) -> "Server":
        """A handle on a server started elsewhere, to measure it; stop() leaves it running."""
        s = cls("", log_path=Path(log_path or os.devnull), served_model_name=served_model_name)
        s.port = port
        return s

    # --- lifecycle ----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def command(self) -> list[str]:
        # --host and --port last: argparse keeps the last value, so no engine argument (an abbreviation like
        # `--hos 0.0.0.0`, a --config file holding `host:`) can make the server listen beyond this machine.
        return [
            self.python,
            "-m",
            "vllm.entrypoints.cli.main",
            "serve",
            self.model,
            "--served-model-name",
            self.served_model_name,
            *self.args,
            "--host",
            HOST,
            "--port",
            str(self.port),
        ]

    def start(self) -> "Server":
        """Start the server and wait until /health answers; ServerDied if it does not."""
        for attempt in range(3):
            self.port = free_port()
            try:
                self._launch()
                self._wait_healthy()
                return self
            except ServerDied as e:
                self.stop()
                if "address already in use" in e.log_tail.lower() and attempt < 2:
                    continue  # another process took the port between our probe and vLLM's bind
                raise
            except BaseException:  # Ctrl-C while starting: __exit__ will not run, so stop here
                self.stop()
                raise
        raise AssertionError("unreachable")

    def _launch(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "a")
        self._log_file.write(f"$ {' '.join(self.command())}\n")
        self._log_file.flush()
        env = {**os.environ, **self.env, MARKER_ENV: self.id, "PYTHONUNBUFFERED": "1"}
        tmp = env.get("TMPDIR") or "/tmp"
        if len(tmp) > IPC_TMPDIR_MAX:  # vLLM's ZMQ sockets live in TMPDIR, and a socket path has at most 107 bytes
            self._short_tmp = tempfile.mkdtemp(prefix="qp-vllm-", dir="/tmp")
            env["TMPDIR"] = self._short_tmp
        self._t0 = time.perf_counter()
        # No new session: the server stays in our process group, which quantpipe's worker kills on SIGTERM.
        self.proc = subprocess.Popen(
            self.command(),
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            preexec_fn=set_pdeathsig,
        )
        self._stop_sampling.clear()
        self._sampler = threading.Thread(target=self._sample_loop, name="server-sampler", daemon=True)
        self._sampler.start()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self._died(f"exited with code {self.proc.returncode} before it was healthy")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        self.start_s = round(time.perf_counter() - self._t0, 2)
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        raise self._died(f"not healthy after {self.startup_timeout_s:.0f} s", use_log=False)

    def _died(self, what: str, use_log: bool = True) -> ServerDied:
        text = self.log_text()
        tail = "\n".join(text.splitlines()[-40:])
        rc = self.proc.poll()
        reason = failure_reason(text) if use_log and rc is not None else f"vllm serve {what}"
        if rc is not None and rc < 0:  # a signal ended it (the OOM killer's SIGKILL, a user's kill): say so first
            try:
                name = signal.Signals(-rc).name
            except ValueError:
                name = f"signal {-rc}"
            reason = f"vllm serve was killed by {name}; {reason}"
        return ServerDied(reason, tail)

    def check_alive(self) -> None:
        """Raise ServerDied if the server has exited (e.g. crashed on a forward pass)."""
        if self.proc is not None and self.proc.poll() is not None:
            raise self._died(f"exited with code {self.proc.returncode}")

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM (vLLM shuts its engine down), then SIGKILL whatever of the tree is left."""
        if self.proc is None:
            return
        self._refresh_tree()
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self._alive():
            time.sleep(0.2)
        for p in self._alive():
            try:
                p.kill()
            except Exception:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for p in self._alive():
            try:
                p.wait(timeout=5)
            except Exception:
                pass
        self._stop_sampling.set()
        if self._sampler is not None and self._sampler is not threading.current_thread():
            self._sampler.join(timeout=5)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._short_tmp:
            shutil.rmtree(self._short_tmp, ignore_errors=True)
            self._short_tmp = None
        if self.port:  # a caller that checks the port right after stop() must find it free
            port_freed(self.port, 10)

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- the process tree ---------------------------------------------------------------------

    def _refresh_tree(self) -> None:
        try:
            import psutil
        except ImportError:
            return
        if self.proc is None:
            return
        try:
            root = psutil.Process(self.proc.pid)
            for p in [root, *root.children(recursive=True)]:
                self._procs.setdefault(p.pid, p)
        except psutil.Error:
            pass
        # Descendants re-parented to init (their parent died) still carry our marker.
        for p in psutil.process_iter(["pid"]):
            if p.pid in self._procs or p.pid == os.getpid():
                continue
            try:
                if p.environ().get(MARKER_ENV) == self.id:
                    self._procs[p.pid] = p
            except psutil.Error:
                pass

    def _alive(self) -> list:
        self._refresh_tree()
        out = []
        for p in list(self._procs.values()):
            try:
                if p.is_running() and p.status() != "zombie":
                    out.append(p)
            except Exception:
                pass
        return out

    def pids(self) -> list[int]:
        """Processes of the server tree that are running now."""
        return [p.pid for p in self._alive()]

    def _sample_loop(self) -> None:
        import psutil

        while not self._stop_sampling.wait(self.sample_interval_s):
            try:
                root = psutil.Process(self.proc.pid)
                tree = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            rss = 0
            for p in tree:
                self._procs.setdefault(p.pid, p)
                try:
                    rss += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak_rss_bytes = max(self.peak_rss_bytes, rss)
            if self.gpu:
                self.peak_gpu_bytes = max(self.peak_gpu_bytes, _gpu_bytes({p.pid for p in tree}))

    # --- talking to it ------------------------------------------------------------------------

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def completion(
        self, prompt: str | list[int], max_tokens: int = 8, model: str | None = None, timeout_s: float = 300
    ) -> dict:
        body = {
            "model": model or self.served_model_name,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
        }
        req = urllib.request.Request(
            f"{self.url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
            self.check_alive()
            detail = e.read().decode(errors="replace")[:500] if isinstance(e, urllib.error.HTTPError) else str(e)
            raise ServerDied(
                f"a completion request failed: {detail}", "\n".join(self.log_text().splitlines()[-40:])
            ) from None

    def metrics_text(self, timeout_s: float = 10) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=timeout_s) as r:
            return r.read().decode()

    def metrics(self) -> dict[str, float]:
        """vLLM's Prometheus metrics, each sample summed over its labels (`name` -> value)."""
        return parse_metrics(self.metrics_text())


def _gpu_bytes(pids: set[int]) -> int:
    """GPU memory used by the given processes, from nvidia-smi (0 where it cannot tell)."""
    total = 0
    for parts in nvidia_smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits", timeout=10):
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit() and int(parts[0]) in pids:
            total += int(parts[1]) * 2**20
    return total
