"""The benchmark's sweep (`measure`) against a live server under a model name it does not serve: every request fails.

<serve env>/bin/python tests/helpers/measure_all_fail.py PIPELINE_DIR CFG.json    exit 3 with "STAGE_ERROR: ..." on stdout
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, sys.argv[1])
import worker  # noqa: E402  (pipeline/worker.py: loads quantpipe from the folder it sits in)

worker._bootstrap()
from quantpipe.recipe import Recipe  # noqa: E402
from quantpipe.server import Server  # noqa: E402
from quantpipe.stages import StageError  # noqa: E402
from quantpipe.stages.benchmark.measure import measure  # noqa: E402

cfg = json.loads(Path(sys.argv[2]).read_text())
recipe = Recipe.model_validate(cfg["recipe"])
srv = Server.connect(cfg["port"], "no-such-model")  # the live server answers every request with 404
try:
    measure(srv, recipe.benchmark, "default", list(recipe.benchmark.workloads), {}, cfg["tokenizer"], Path(cfg["out"]))
except StageError as e:
    print("STAGE_ERROR:", e)
    sys.exit(3)
