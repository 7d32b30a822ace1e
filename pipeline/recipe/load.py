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
from .schema import HUB_ID, Recipe

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
    """Make the recipe's local paths absolute (relative to the recipe file's folder)."""

    def fix(p: str | None, field: str) -> str | None:
        if p is None:
            return None
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

    def listed(v) -> list:
        return v if isinstance(v, list) else []  # anything else is the schema's to refuse

    base = data.get("base")
    if isinstance(base, dict) and isinstance(base.get("model"), str):
        m = base["model"]
        if m.startswith((".", "/", "~")) or _exists(root / m) or not HUB_ID.match(m):
            base["model"] = fix(m, "base.model")
    for i, a in enumerate(listed(data.get("adapters"))):
        if isinstance(a, dict) and isinstance(a.get("path"), str):
            a["path"] = fix(a["path"], f"adapters.{i}.path")
    cal = data.get("calibration")
    if isinstance(cal, dict):
        for i, s in enumerate(listed(cal.get("sources"))):
            if isinstance(s, dict) and isinstance(s.get("path"), str):
                s["path"] = fix(s["path"], f"calibration.sources.{i}.path")
    ev = data.get("evaluation")
    if isinstance(ev, dict):
        if isinstance(ev.get("lm_eval"), dict) and isinstance(ev["lm_eval"].get("include_path"), str):
            ev["lm_eval"]["include_path"] = fix(ev["lm_eval"]["include_path"], "evaluation.lm_eval.include_path")
        val = ev.get("validation")
        if isinstance(val, dict):
            for k in ("path", "json_schema"):
                if isinstance(val.get(k), str):
                    val[k] = fix(val[k], f"evaluation.validation.{k}")
        fid = ev.get("fidelity")
        if isinstance(fid, dict) and isinstance(fid.get("path"), str):
            fid["path"] = fix(fid["path"], "evaluation.fidelity.path")
    for k in ("output_dir", "cache_dir"):
        if isinstance(data.get(k), str):
            data[k] = fix(data[k], k)
    return data


def _exists(p: Path) -> bool:
    try:
        return p.exists()
    except OSError:  # a name too long for the file system...
        return False


def _check_files(r: Recipe) -> list[str]:
    """Problems with the files a recipe points at, found before anything runs."""
    problems = []
    if r.base.is_local:
        p = Path(r.base.model)
        if not p.is_dir():
            problems.append(f"base.model: {p} is not a directory; give a local model directory or a hub id (org/name)")
        elif not (p / "config.json").is_file():
            problems.append(f"base.model: {p} has no config.json; point it at a Hugging Face model directory")
        else:
            has_st = any(p.glob("*.safetensors"))
            has_bin = any(p.glob("*.bin")) or any(p.glob("*.pt"))
            if not has_st and has_bin and not r.base.allow_pickle:
                problems.append(
                    f"base.model: {p} has only pickle (.bin) weights, which can run code when loaded; convert them to "
                    "safetensors or set base.allow_pickle: true if you trust the files"
                )
            elif not has_st and not has_bin:
                problems.append(f"base.model: {p} holds no weights (*.safetensors)")
        if r.base.revision is not None:
            problems.append(
                f"base.revision: applies to hub ids only, and base.model is the local directory {p}; remove it"
            )
    for i, a in enumerate(r.adapters):
        p = Path(a.path)
        if not p.is_dir():
            problems.append(f"adapters.{i}.path: {p} is not a directory")
        elif not (p / "adapter_config.json").is_file():
            problems.append(f"adapters.{i}.path: {p} is not a LoRA adapter (no adapter_config.json)")
        elif not (p / "adapter_model.safetensors").is_file():
            if (p / "adapter_model.bin").is_file() and not r.base.allow_pickle:
                problems.append(
                    f"adapters.{i}.path: {p} has only a pickle adapter_model.bin; convert it to safetensors "
                    "or set base.allow_pickle: true if you trust it"
                )
            elif not (p / "adapter_model.bin").is_file():
                problems.append(f"adapters.{i}.path: {p} has no adapter_model.safetensors")
    if r.calibration:
        for i, s in enumerate(r.calibration.sources):
            if s.path and not Path(s.path).is_file():
                problems.append(f"calibration.sources.{i}.path: {s.path} does not exist")
            elif s.path and not s.path.endswith((".jsonl", ".json", ".parquet")):
                problems.append(f"calibration.sources.{i}.path: {s.path} must be .jsonl, .json or .parquet")
    ev = r.evaluation
    if ev.lm_eval and ev.lm_eval.include_path and not Path(ev.lm_eval.include_path).is_dir():
        problems.append(f"evaluation.lm_eval.include_path: {ev.lm_eval.include_path} is not a directory")
    if ev.validation:
        if not Path(ev.validation.path).is_file():
            problems.append(f"evaluation.validation.path: {ev.validation.path} does not exist")
        if ev.validation.json_schema and not Path(ev.validation.json_schema).is_file():
            problems.append(f"evaluation.validation.json_schema: {ev.validation.json_schema} does not exist")
    if ev.fidelity and not Path(ev.fidelity.path).is_file():
        problems.append(
            f'evaluation.fidelity.path: {ev.fidelity.path} does not exist; point it at a JSONL file of held-out documents, one {{"text": ...}} per line'
        )
    return problems


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
        problems = _check_files(recipe) if check_files else []
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
