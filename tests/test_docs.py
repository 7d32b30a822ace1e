"""The generated docs are current: docs/recipes.md is what scripts/recipe_docs.py makes of the recipe schema (fast).

.venv/quantize/bin/python -m pytest tests/test_docs.py -q
"""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REGENERATE = ".venv/quantize/bin/python scripts/recipe_docs.py > docs/recipes.md"


def _generator():
    spec = importlib.util.spec_from_file_location("recipe_docs", REPO / "scripts" / "recipe_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_recipe_reference_matches_the_schema():
    expected = _generator().render()
    current = (REPO / "docs" / "recipes.md").read_text(encoding="utf-8")
    assert current == expected, (
        f"docs/recipes.md is out of date with the recipe schema; regenerate it with `{REGENERATE}`"
    )


def test_recipe_reference_documents_every_method_and_field():
    from quantpipe.recipe import METHODS, Recipe

    text = _generator().render()
    for method in METHODS:
        assert f"## artifacts[] (method: {method})" in text, method
    for name in Recipe.model_fields:
        assert f"| `{name}` |" in text, name
