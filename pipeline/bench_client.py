"""`vllm bench serve`, many runs from one process: vLLM's CLI is imported once, then each run is a
child forked from this process that calls the CLI's `main()` with the run's arguments, exactly what
`python -m vllm.entrypoints.cli.main bench serve ARGS` does after its imports (10-20 s of them on 2
CPU cores, ~20 s on the H200 host: the largest item of a sweep after the server's start).

The benchmark stage (stages/benchmark.py) starts it in the serve environment and talks JSON lines:

    stdin:  {"args": [ARG, ...], "log": "/path/to/run.log"}     one run; its output is appended to log
    stdout: {"rc": EXIT_CODE}                                     when the run's child has exited

It imports nothing of quantpipe, so it runs from its file path in any environment that has vLLM.
"""

import json
import os
import signal
import sys
import traceback


def preload() -> None:
    """The modules `vllm.entrypoints.cli.main.main()` imports, and the serving benchmark itself."""
    import vllm.benchmarks.serve  # noqa: F401
    import vllm.entrypoints.cli.benchmark.main  # noqa: F401
    import vllm.entrypoints.cli.collect_env  # noqa: F401
    import vllm.entrypoints.cli.download_kernels  # noqa: F401
    import vllm.entrypoints.cli.launch  # noqa: F401
    import vllm.entrypoints.cli.main  # noqa: F401
    import vllm.entrypoints.cli.openai  # noqa: F401
    import vllm.entrypoints.cli.preload  # noqa: F401
    import vllm.entrypoints.cli.run_batch  # noqa: F401
    import vllm.entrypoints.cli.serve  # noqa: F401
    import vllm.entrypoints.cli.snapshot  # noqa: F401
    import vllm.entrypoints.serve.utils.api_utils  # noqa: F401


def run_child(args: list[str], log: str) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: stdin from /dev/null, stdout and stderr into the run's log, then the CLI
        code = 1
        try:
            try:
                import ctypes

                ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
            except OSError:
                pass
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.argv = ["vllm", "bench", "serve", *args]
            from vllm.entrypoints.cli.main import main

            main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def main() -> None:
    preload()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        print(json.dumps({"rc": run_child(req["args"], req["log"])}), flush=True)


if __name__ == "__main__":
    main()
