"""Run the benchmark's sweep (`measure`) against a server that is already up, in the serve environment; write its rows.

<serve env>/bin/python tests/helpers/measure_server.py CFG.json   # CFG: port, model, recipe, tokenizer, out, result
"""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "pipeline"))
import worker  # noqa: E402  (pipeline/worker.py: loads quantpipe from the folder it sits in)

worker._bootstrap()
from quantpipe.recipe import Recipe  # noqa: E402
from quantpipe.server import Server  # noqa: E402
from quantpipe.stages.benchmark.measure import measure  # noqa: E402

cfg = json.loads(Path(sys.argv[1]).read_text())
recipe = Recipe.model_validate(cfg["recipe"])
rows, _ = measure(
    Server.connect(cfg["port"], cfg["model"]),
    recipe.benchmark,
    "default",
    list(recipe.benchmark.workloads),
    {},
    cfg["tokenizer"],
    Path(cfg["out"]),
)
Path(cfg["result"]).write_text(json.dumps(rows))
