"""Run one stage from its worker spec the way a notebook would call it: no worker signal handling, so that
Ctrl-C reaches the stage itself as KeyboardInterrupt.

    <env>/bin/python tests/helpers/stage_direct.py SPEC.json
"""

import importlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "pipeline"))
import worker  # noqa: E402  (pipeline/worker.py: loads quantpipe from the folder it sits in)

worker._bootstrap()
from quantpipe.envs import STAGES  # noqa: E402
from quantpipe.stages.contract import INPUTS, Upstream  # noqa: E402

spec = json.loads(Path(sys.argv[1]).read_text())
module, fn = STAGES[spec["kind"]][0].split(":")
run = getattr(importlib.import_module(module), fn)
upstream = {role: Upstream.from_json(u) for role, u in spec.get("upstream", {}).items()}
metrics = run(INPUTS[spec["kind"]].model_validate(spec["input"]), Path(spec["src"]), Path(spec["out"]), upstream)
Path(spec["metrics"]).write_text(json.dumps(metrics, indent=2, default=str))
