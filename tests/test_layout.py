"""The code's shape: cache keys follow the code a stage imports, no import cycles, stages independent, modules small."""

from __future__ import annotations

import shutil
from pathlib import Path

from quantpipe.envs import PACKAGE_DIR, STAGES, _module_file, import_closure, imports_of, source_hash


def _modules(root: Path = PACKAGE_DIR) -> list[str]:
    names = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        names.append(".".join(["quantpipe", *parts]))
    return names


def test_package_key_changes_with_a_module_it_reaches_only_through_another(tmp_path):
    """The package stage reaches common/gates.py only through its card module: editing it changes the package's
    code hash (and so its cache key), and leaves the merge stage's alone."""
    root = tmp_path / "quantpipe"
    shutil.copytree(PACKAGE_DIR, root, ignore=shutil.ignore_patterns("__pycache__"))
    before = {k: source_hash(k, root) for k in STAGES}
    assert root / "common" / "gates.py" in import_closure("quantpipe.stages.package", root)
    assert "quantpipe.common.gates" not in imports_of("quantpipe.stages.package", root)  # indirect, through card.py
    with open(root / "common" / "gates.py", "a") as f:
        f.write("\nMIN_RECOVERY_DEFAULT = None\n")
    after = {k: source_hash(k, root) for k in STAGES}
    assert after["package"] != before["package"]
    assert after["merge"] == before["merge"] and after["quantize"] == before["quantize"]


def test_code_hash_covers_the_templates_a_stage_renders(tmp_path):
    root = tmp_path / "quantpipe"
    shutil.copytree(PACKAGE_DIR, root, ignore=shutil.ignore_patterns("__pycache__"))
    before = source_hash("package", root)
    with open(root / "templates" / "model_card.md.j2", "a") as f:
        f.write("\n")
    assert source_hash("package", root) != before
    assert source_hash("merge", root) == source_hash("merge", PACKAGE_DIR)


def test_no_import_cycles():
    """Module-level and function-level imports between quantpipe modules form no cycle."""
    graph = {m: {d for d in imports_of(m) if d != m and _module_file(d, PACKAGE_DIR) is not None} for m in _modules()}
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if m.startswith(d + "."):  # a module importing its own package's __init__ is not a cycle of code
                continue
            if state.get(d) == 1:
                cycles.append(path[path.index(d) :] + [d] if d in path else [m, d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [m])
    assert not cycles, f"import cycles: {cycles}"


def test_stages_never_import_each_other():
    stages = {"quantpipe.stages." + k for k in STAGES}
    for s in stages:
        own = {m for m in _modules() if m == s or m.startswith(s + ".")}
        for m in own:
            others = {d for d in imports_of(m) for o in stages - {s} if d == o or d.startswith(o + ".")}
            assert not others, f"{m} imports {others}: move what they share to quantpipe.common"


CONFIG_DIMENSIONS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "head_dim",
    "max_position_embeddings",
    "vocab_size",
)


def test_model_shape_is_read_from_config_json_in_one_place():
    """config.json's dimension keys are named only in common/shape.py (ModelShape): every other module asks it, so
    the shape is parsed one way everywhere."""
    home = PACKAGE_DIR / "common" / "shape.py"
    found = []
    for f in sorted(PACKAGE_DIR.rglob("*.py")):
        if f == home:
            continue
        text = f.read_text()
        found += [
            f"{f.relative_to(PACKAGE_DIR)}: {q}{k}{q}" for k in CONFIG_DIMENSIONS for q in "\"'" if f"{q}{k}{q}" in text
        ]
    assert not found, f"config.json dimension keys outside common/shape.py (ask ModelShape instead): {found}"


def test_model_shape_stays_in_the_common_layer():
    """common/shape.py imports nothing from the stages, the runner, the reports or the CLI."""
    higher = ("quantpipe.stages", "quantpipe.run", "quantpipe.report", "quantpipe.cli")
    reached = {d for d in imports_of("quantpipe.common.shape") if d.startswith(higher)}
    assert not reached, f"quantpipe.common.shape imports {reached}"
