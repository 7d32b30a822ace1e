"""Reading a recipe file: safe YAML (no key written twice), paths resolved against the recipe's folder, the schema, the
files it names. Every problem becomes one RecipeError naming the field and the fix (pydantic's as `field: message`):

    from quantpipe.recipe import load
    recipe = load("recipes/demo.yaml")   # RecipeError: recipes/demo.yaml: 1 problem(s) in the recipe: ...
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from .methods import METHODS
from .paths import HUB_ID, LocalPathMarker, input_paths, map_paths
from .schema import Recipe

MAX_RECIPE_BYTES = 1 << 20
METHODS_TAGS = set(METHODS)


class RecipeError(Exception):
    """A recipe that cannot be used; the message names the field and the fix."""


def _format_error(err: ValidationError, source: str) -> str:
    lines = [f"{source}: {err.error_count()} problem(s) in the recipe:"]
    for e in err.errors():
        parts = list(e["loc"])
        if len(parts) > 2 and parts[0] == "artifacts" and parts[2] in METHODS_TAGS:
            del parts[2]  # the union's tag (artifacts.0.awq.group_size): not a key the user wrote
        loc = ".".join(str(p) for p in parts)
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key; remove it or fix its spelling (`quantpipe schema` lists the keys)"
        elif e["type"] == "union_tag_invalid":
            msg = (
                f"unknown method {e['input'].get('method')!r}; use one of: {', '.join(METHODS)}"
                if isinstance(e.get("input"), dict)
                else msg
            )
        elif e["type"] == "union_tag_not_found":
            msg = f"missing `method`; use one of: {', '.join(METHODS)}"
        lines.append(f"  - {loc or '(top level)'}: {msg}")
    return "\n".join(lines)


# --- YAML ------------------------------------------------------------------------------------


def _read_yaml(text: str, source: str) -> Any:
    """yaml.safe_load, refusing a key written twice in one mapping (PyYAML would keep the last one silently)."""
    loader = yaml.SafeLoader(text)
    try:
        # SafeLoader: no Python objects; MAX_RECIPE_BYTES bounds an alias bomb's input, `_check_size` its expansion
        node = loader.get_single_node()
        if node is None:
            return None
        twice = _written_twice(loader, node)
        if twice:
            raise RecipeError(
                f"{source}: " + "; ".join(twice) + ". YAML keeps only the last one: delete the one you do not mean"
            )
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _written_twice(loader: yaml.SafeLoader, root: yaml.Node) -> list[str]:
    """`field` written twice (lines a and b), for every mapping in the document (each node visited once: aliases do not multiply)."""
    out, seen, stack = [], set(), [(root, "")]
    while stack:
        node, where = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                    try:
                        key = loader.construct_object(k)
                    except yaml.YAMLError:
                        key = None
                    if key is not None:
                        try:
                            if key in first:
                                a, b = first[key], k.start_mark
                                at = (
                                    f"lines {a.line + 1} and {b.line + 1}"
                                    if a.line != b.line
                                    else f"line {a.line + 1}, columns {a.column + 1} and {b.column + 1}"
                                )
                                out.append((a.line, f"{f'{where}.{key}' if where else key} is written twice ({at})"))
                            else:
                                first[key] = k.start_mark
                        except TypeError:  # unhashable: the constructor refuses it below
                            pass
                    stack.append((v, f"{where}.{key}" if where else str(key)))
                else:
                    stack.append((v, where))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((v, f"{where}.{i}" if where else str(i)) for i, v in enumerate(node.value))
    return [msg for _, msg in sorted(out)]


def _check_size(data: Any, source: str, limit: int = 100_000) -> None:
    """Refuse documents that expand (YAML aliases) into more nodes than any sane recipe has."""
    seen, stack = 0, [data]
    while stack:
        node = stack.pop()
        seen += 1
        if seen > limit:
            raise RecipeError(
                f"{source}: the YAML expands to over {limit} values (an alias bomb?); write the recipe out plainly"
            )
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


# --- paths -----------------------------------------------------------------------------------


def _resolve_paths(data: dict, root: Path) -> dict:
    """Make the recipe's local paths absolute (relative to the recipe file's folder): every field typed as a path
    (recipe/paths.py), a hub id left as it is where the field may hold one."""

    def fix(p: str, field: str, marker: LocalPathMarker) -> str:
        if marker.hub_id and not (p.startswith((".", "/", "~")) or _exists(root / p) or not HUB_ID.match(p)):
            return p
        try:
            q = Path(p).expanduser()
        except RuntimeError:  # ~user of a user that does not exist: a relative path like any other
            q = Path(p)
        if len(os.fsencode(root / q)) > 4095 or any(len(os.fsencode(c)) > 255 for c in q.parts):
            raise RecipeError(f"{field}: {p[:60]!r}... is longer than a file path can be; fix the path")
        if q.is_absolute():
            return str(q)
        try:
            return str((root / q).resolve())
        except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL byte: the file checks report it missing
            return os.path.abspath(root / q)

    return map_paths(data, Recipe, fix)


def _exists(p: Path) -> bool:
    try:
        return p.exists()
    except OSError:  # a name too long for the file system...
        return False


def _model_dir_problems(p: Path, field: str, allow_pickle: bool) -> list[str]:
    if not (p / "config.json").is_file():
        return [f"{field}: {p} has no config.json; point it at a Hugging Face model directory"]
    has_st = any(p.glob("*.safetensors"))
    has_bin = any(p.glob("*.bin")) or any(p.glob("*.pt"))
    if not has_st and has_bin and not allow_pickle:
        return [
            f"{field}: {p} has only pickle (.bin) weights, which can run code when loaded; convert them to "
            "safetensors or set base.allow_pickle: true if you trust the files"
        ]
    if not has_st and not has_bin:
        return [f"{field}: {p} holds no weights (*.safetensors)"]
    return []


def _adapter_dir_problems(p: Path, field: str, allow_pickle: bool) -> list[str]:
    if not (p / "adapter_config.json").is_file():
        return [f"{field}: {p} is not a LoRA adapter (no adapter_config.json)"]
    if (p / "adapter_model.safetensors").is_file():
        return []
    if (p / "adapter_model.bin").is_file():
        if allow_pickle:
            return []
        return [
            f"{field}: {p} has only a pickle adapter_model.bin; convert it to safetensors "
            "or set base.allow_pickle: true if you trust it"
        ]
    return [f"{field}: {p} has no adapter_model.safetensors"]


_HOLDS = {"model": _model_dir_problems, "adapter": _adapter_dir_problems}


def _path_problems(value: str, field: str, marker: LocalPathMarker, allow_pickle: bool) -> list[str]:
    """What is wrong with one input path the recipe names: missing, of the wrong kind or suffix, or not holding what
    its field says it holds."""
    hint = f"; {marker.hint}" if marker.hint else ""
    if marker.is_dir:
        p = Path(value)
        if not p.is_dir():
            alt = "; give a local model directory or a hub id (org/name)" if marker.hub_id else ""
            return [f"{field}: {p} is not a directory{alt or hint}"]
        return _HOLDS[marker.holds](p, field, allow_pickle) if marker.holds else []
    if not Path(value).is_file():
        return [f"{field}: {value} does not exist{hint}"]
    if marker.suffixes and not value.endswith(marker.suffixes):
        *most, last = marker.suffixes
        return [f"{field}: {value} must be {', '.join(most)} or {last}" if most else f"{field}: {value} must be {last}"]
    return []


def _check_files(r: Recipe) -> list[str]:
    """Problems with the files a recipe points at, found before anything runs: every input path field (recipe/paths.py)."""
    problems = []
    for field, value, marker in input_paths(r):
        problems += _path_problems(value, field, marker, r.base.allow_pickle)
    return problems


def _revision_problems(r: Recipe) -> list[str]:
    """A hub revision for a base model that turned out to be a local directory."""
    if r.base.is_local and r.base.revision is not None:
        return [
            f"base.revision: applies to hub ids only, and base.model is the local directory {Path(r.base.model)}; remove it"
        ]
    return []


# --- the recipe ------------------------------------------------------------------------------


def parse(text: str, root: Path, source: str = "recipe", check_files: bool = True) -> Recipe:
    """Validate recipe text; raise RecipeError with every problem listed."""
    if len(text.encode("utf-8", "replace")) > MAX_RECIPE_BYTES:
        raise RecipeError(f"{source}: larger than 1 MiB; a recipe is a short YAML file")
    try:
        data = _read_yaml(text, source)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise RecipeError(
            f"{source}: not valid YAML{where}: {getattr(e, 'problem', None) or e}. Fix the syntax there."
        ) from None
    except RecursionError:
        raise RecipeError(f"{source}: YAML nested too deeply") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{source}: a recipe is a YAML mapping (key: value lines), got {type(data).__name__}")
    _check_size(data, source)
    try:
        data = _resolve_paths(data, root)
    except RecipeError as e:
        raise RecipeError(f"{source}: {e}") from None
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(_format_error(e, source)) from None
    try:
        problems = _check_files(recipe) + _revision_problems(recipe) if check_files else []
    except OSError as e:  # a path the file system refuses (too long, no permission to look): name it
        raise RecipeError(
            f"{source}: cannot check a path it names: {e.strerror or e}: {e.filename!r}; fix that path"
        ) from None
    if problems:
        raise RecipeError(
            f"{source}: {len(problems)} problem(s) with the files it names:\n" + "\n".join(f"  - {p}" for p in problems)
        )
    return recipe


def load(path: str | Path, check_files: bool = True) -> Recipe:
    """Read and validate a recipe file."""
    p = Path(path)
    if not p.is_file():
        raise RecipeError(f"{path}: no such recipe file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise RecipeError(f"{path}: not a text file; a recipe is UTF-8 YAML") from None
    except OSError as e:
        raise RecipeError(f"{path}: cannot read it ({e.strerror})") from None
    return parse(text, p.resolve().parent, source=str(path), check_files=check_files)


def json_schema() -> dict:
    return Recipe.model_json_schema()
