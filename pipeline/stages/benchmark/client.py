"""`vllm bench serve` runs from client processes that import vLLM's CLI before the measuring begins: a fresh
`vllm bench serve` spends 8-35 s importing vLLM before its first request, once per sweep point. Where runs fork
(`fork_here`), one client process imports the CLI once and each run is a child forked from it that calls the CLI's own
`main()` (same parser, request loop and result file; only the imports are shared). Elsewhere each run is a process of
its own (`--once`) that imports the CLI, says it is ready, takes one run and exits; the stage starts the first one beside
the server's start (`start()`), so that its imports fall outside the stretch in which nothing else may run.
bench/bench_agreement.py measures both kinds against fresh `vllm bench serve` processes (tests/test_benchmark.py runs it).
Run as a program (serve environment) this file is the client: one JSON request per line on stdin
({"args": [...], "log": path}), one {"rc": N} per line on stdout; with `--once`, first a {"ready": true} line.

    with BenchClient(out / "logs" / "bench-client.log") as client:
        client.run(["--host", "127.0.0.1", "--port", "8000", ...], out / "logs" / "bench-fixed-c4.log")  # exit code
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CLI_MODULES = ("collect_env", "download_kernels", "launch", "openai", "preload", "run_batch", "serve", "snapshot")


def run_logged(cmd: list[str], log_path: Path) -> int:
    """Run a vLLM CLI command with its output in `log_path`; on Ctrl-C or SIGTERM end it before re-raising."""
    from ...server import set_pdeathsig

    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as logf:
        logf.write("$ " + " ".join(cmd) + "\n")
        logf.flush()
        p = subprocess.Popen(
            cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=set_pdeathsig
        )
        try:
            return p.wait()
        except BaseException:
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
            raise


def fork_here() -> bool:
    """True on a CUDA host, where forked runs agree with fresh `vllm bench serve` processes within 2 % (an 8B on an H200,
    docs/BENCHMARKS.md). On a CPU the client shares the server's few cores and forked runs read up to 15 % more
    throughput in paired rounds, so there each run is a fresh process, as a user would start it."""
    from vllm.platforms import current_platform

    return current_platform.is_cuda_alike()


class BenchClient:
    """The client process, started on the first run or by `start()`; `close()` (or leaving the `with` block) ends it.
    With `fork` False (default: not `fork_here()`) every run is a process of its own (`--once`)."""

    def __init__(self, log_path: Path, fork: bool | None = None):
        self.log_path = Path(log_path)
        self.fork = fork
        self._proc: subprocess.Popen | None = None
        self._ready = False  # the `--once` process has said it imported the CLI

    def __enter__(self) -> BenchClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Start the client (or, where runs do not fork, the first run's process) now, so that its imports (~25 s for
        vLLM on an H200 host, ~8 s on a 2-core CPU) overlap the server's start instead of preceding the first run."""
        if self.fork is None:
            self.fork = fork_here()
        if not (self._proc and self._proc.poll() is None):
            self._start()

    def _start(self) -> subprocess.Popen:
        from ...server import set_pdeathsig

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._ready = False
        with open(self.log_path, "a") as logf:
            self._proc = subprocess.Popen(
                [sys.executable, __file__, *(() if self.fork else ("--once",))],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=logf,
                text=True,
                preexec_fn=set_pdeathsig,
            )
        return self._proc

    def ready(self) -> None:
        """Start the next run's process if none is waiting, and wait until it has imported the CLI (`--once`)."""
        self.start()
        if not self.fork and not self._ready:
            self._reply(self._proc, "ready")
            self._ready = True

    def run(self, args: list[str], log_path: Path) -> int:
        """`vllm bench serve ARGS` with its output in `log_path`; its exit code. Ctrl-C or SIGTERM ends the run too."""
        self.ready()
        p = self._proc
        log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            p.stdin.write(json.dumps({"args": args, "log": str(log_path)}) + "\n")
            p.stdin.flush()
        except BaseException:
            self.close()  # the client's children die with it (PR_SET_PDEATHSIG)
            raise
        rc = int(self._reply(p, "rc"))
        if not self.fork:  # one run per process: the next run starts a fresh one
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            self.close()
        return rc

    def _reply(self, p: subprocess.Popen, key: str):
        try:
            line = p.stdout.readline()
        except BaseException:
            self.close()
            raise
        if not line:
            self.close()
            raise RuntimeError(
                f"the vllm bench serve client exited (code {p.poll()}); its output is in {self.log_path}"
            )
        return json.loads(line)[key]

    def close(self) -> None:
        p, self._proc = self._proc, None
        if p is None:
            return
        if p.poll() is None:
            p.kill()
        p.wait()
        for f in (p.stdin, p.stdout):
            f.close()


def _serve_requests(once: bool) -> None:
    """The client's loop, or with `once` a single run in this process (see the module docstring)."""
    import ctypes
    import importlib
    import signal
    import traceback

    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever vLLM prints goes to the client's log, never into the replies
    sys.argv = ["vllm", "bench", "serve"]  # what vLLM's CLI module looks at while it is imported
    import vllm.entrypoints.cli.main as cli

    try:
        from vllm.entrypoints.cli.benchmark import main as bench_main

        bench_main._import_bench_subcommand_modules()
    except (ImportError, AttributeError):
        pass  # a vLLM without it: `main()` then imports the subcommands in every run
    for name in ("vllm.benchmarks.serve", *(f"vllm.entrypoints.cli.{m}" for m in CLI_MODULES)):
        try:  # what `main()` imports on each call: imported here once, found in sys.modules by every child
            importlib.import_module(name)
        except ImportError:
            pass

    if once:
        proto.write(json.dumps({"ready": True}) + "\n")
        proto.flush()
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = 0 if once else os.fork()
        if pid == 0:
            code = 1
            try:
                ctypes.CDLL("libc.so.6", use_errno=True).prctl(
                    1, signal.SIGTERM
                )  # PR_SET_PDEATHSIG: die with the client
                fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                print(f"$ vllm bench serve {' '.join(req['args'])}  # process {os.getpid()}", flush=True)
                sys.argv = ["vllm", "bench", "serve", *req["args"]]
                cli.main()
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                if once:
                    proto.write(json.dumps({"rc": code}) + "\n")
                    proto.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        proto.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        proto.flush()


if __name__ == "__main__":
    sys.path.pop(0)  # this file's folder: its modules (engine, stats, ...) must not shadow vLLM's imports
    _serve_requests(once="--once" in sys.argv[1:])
