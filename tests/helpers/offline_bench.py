"""The benchmark's offline figures (`vllm bench latency` / `throughput`) on a model, in the serve environment.

<serve env>/bin/python tests/helpers/offline_bench.py PIPELINE_DIR MODEL_DIR OUT_DIR    prints RESULT{json}
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, sys.argv[1])
import worker  # noqa: E402  (pipeline/worker.py: loads quantpipe from the folder it sits in)

worker._bootstrap()
from quantpipe.recipe import Workload  # noqa: E402
from quantpipe.stages.benchmark.offline import offline  # noqa: E402

out = Path(sys.argv[3])
(out / "logs").mkdir(parents=True)
engine = {"dtype": "bfloat16", "max_model_len": 256, "enforce_eager": True, "kv_cache_memory_bytes": 256 * 2**20}
workload = Workload(name="fixed", input_len=32, output_len=16, num_prompts=8)
print("RESULT" + json.dumps(offline(Path(sys.argv[2]), engine, workload, out)))
