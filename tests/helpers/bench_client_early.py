"""In the serve environment: a BenchClient started before its first run serves that run from the same process.

    python tests/helpers/bench_client_early.py OUT_DIR     prints {"pid_started", "pid_first_run", "rc", "log"} as JSON
"""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "pipeline"))
import worker  # noqa: E402  (pipeline/worker.py: loads quantpipe from the folder it sits in)

worker._bootstrap()
from quantpipe.stages.benchmark.client import BenchClient  # noqa: E402

out = Path(sys.argv[1])
with BenchClient(out / "client.log", fork=True) as client:
    client.start()
    started = client._proc.pid
    rc = client.run(["--help"], out / "help.log")
    print(json.dumps({"pid_started": started, "pid_first_run": client._proc.pid, "rc": rc, "log": (out / "help.log").read_text()}))
