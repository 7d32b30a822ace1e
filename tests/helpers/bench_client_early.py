"""In the serve environment: a BenchClient started before its first run serves that run from the process it started.

    python tests/helpers/bench_client_early.py OUT_DIR FORK    FORK: yes (runs fork from one client) or no (a process per run)
prints {"pid_started", "pids" (the process of each of two runs, from their logs), "rc", "log"} as JSON
"""

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "pipeline"))
import worker  # noqa: E402  (pipeline/worker.py: loads quantpipe from the folder it sits in)

worker._bootstrap()
from quantpipe.stages.benchmark.client import BenchClient  # noqa: E402

out, fork = Path(sys.argv[1]), sys.argv[2] == "yes"
with BenchClient(out / "client.log", fork=fork) as client:
    client.start()
    started = client._proc.pid
    rc = [client.run(["--help"], out / f"help{i}.log") for i in range(2)]
logs = [(out / f"help{i}.log").read_text() for i in range(2)]
pids = [int(re.search(r"# process (\d+)", text).group(1)) for text in logs]
print(json.dumps({"pid_started": started, "pids": pids, "rc": rc, "log": logs[0]}))
