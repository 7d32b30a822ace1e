"""The recipe: one strict schema for everything `quantpipe run` does. YAML read safely (a key written twice is an
error), validated by the pydantic v2 models of `schema.py`, `benchmark.py` and `methods.py`, its path fields typed as
paths (`paths.py`) and resolved against the recipe's folder (`load.py`). `quantpipe check` validates without running,
the files it names included:

    quantpipe check recipes/demo.yaml
"""

from .benchmark import SLO, Benchmark, Engine, Variant, Workload
from .load import MAX_RECIPE_BYTES, RecipeError, json_schema, load, parse
from .methods import (
    AWQ,
    FP8,
    GPTQ,
    GROUPED,
    METHODS,
    NAME,
    RTN,
    Artifact,
    Strict,
    W8A8Int8,
    _legacy_options,
    group_sizes,
)
from .paths import HUB_ID, LocalPathMarker, input_paths, path_values
from .schema import (
    Adapter,
    Base,
    Calibration,
    CalibrationSource,
    Evaluation,
    Fidelity,
    Gates,
    LmEval,
    Package,
    Recipe,
    Validation,
)

__all__ = [
    "AWQ",
    "FP8",
    "GPTQ",
    "GROUPED",
    "HUB_ID",
    "LocalPathMarker",
    "MAX_RECIPE_BYTES",
    "METHODS",
    "NAME",
    "RTN",
    "SLO",
    "Adapter",
    "Artifact",
    "Base",
    "Benchmark",
    "Calibration",
    "CalibrationSource",
    "Engine",
    "Evaluation",
    "Fidelity",
    "Gates",
    "LmEval",
    "Package",
    "Recipe",
    "RecipeError",
    "Strict",
    "Validation",
    "Variant",
    "W8A8Int8",
    "Workload",
    "_legacy_options",
    "group_sizes",
    "input_paths",
    "json_schema",
    "load",
    "parse",
    "path_values",
]
