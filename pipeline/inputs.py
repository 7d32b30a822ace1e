"""The data a recipe names, read as the stages will read it (without torch) before anything runs.

`recipe.load` checks the recipe and that its files exist; this reads calibration, validation and fidelity rows, the
safetensors files of the base and the adapters against their own headers, adapters against their config and the base
model, links that leave those folders (`common/links.py`), config.json and the tokenizer (`quantpipe.fit`), the rows
as the tokenizer makes them (`quantpipe.tokenized`), lm-eval tasks (`quantpipe.lm_tasks`) and where the run writes
(`quantpipe.places`). A bad row, a truncated shard, an adapter whose config is not its weights' or that was trained on
another model, a group size the layers cannot take, a prompt longer than the context or a misspelt task is then bad
input (exit 2, the field or file and line named) in `quantpipe check` and before `quantpipe run` writes anything, not a
stage failure an hour in. "Without torch": the one exception is `quantpipe.tokenized`, asked last, which loads a
tokenizer through transformers:

    from quantpipe.inputs import problems
    problems(recipe)   # -> [] or ["data/val.jsonl:7: `reference` must be a non-empty string (metric exact_match)", ...]
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .common.hf_config import read_config
from .common.safetensors import read_header, tensors
from .common.shape import ModelShape, architecture_differences

LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_(A|B)(?:\.[\w-]+)?\.weight$")
LORA_TENSOR = re.compile(r"layers\.(\d+)\..*?\b(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_(A|B)\b")


def problems(recipe) -> list[str]:
    """Every problem found in the places the recipe writes and the local files it reads."""
    from . import fit, lm_tasks, places, tokenized

    out = places.problems(recipe)
    needs_template, val_rows, cal_rows = _data_problems(recipe, out)
    model_dir = Path(recipe.base.model) if recipe.base.is_local else _hub_snapshot(recipe)
    out += _link_problems(recipe, model_dir)
    out += _weight_problems(recipe, model_dir)
    for i, a in enumerate(recipe.adapters):
        msg = adapter_mismatch(Path(a.path), model_dir)
        if msg:
            out.append(f"adapters.{i}.path: {a.path} {msg}")
    if model_dir is not None:
        out += fit.problems(recipe, model_dir)
        out += fit.tokenizer_problems(recipe, model_dir)
        out += fit.chat_template_problems(recipe, model_dir, needs_template)
    out += lm_tasks.problems(recipe)
    if model_dir is not None and not out:  # the only check that loads a tokenizer: last, on files that passed the rest
        out += tokenized.problems(recipe, model_dir, val_rows, cal_rows)
    return out


def _input_folders(recipe, model_dir: Path | None) -> list[tuple[str, Path]]:
    """(recipe field, folder) of the base model (when local) and each adapter: the folders other people hand over."""
    folders = [("base.model", model_dir)] if model_dir is not None else []
    return folders + [(f"adapters.{i}.path", Path(a.path)) for i, a in enumerate(recipe.adapters)]


def _link_problems(recipe, model_dir: Path | None) -> list[str]:
    """Links in the base model or an adapter folder whose target lies outside it (common/links.py)."""
    from .common.links import escape_sentence, escaping_links

    out = []
    for field, folder in _input_folders(recipe, model_dir):
        links = escaping_links(folder)
        if links:
            out.append(escape_sentence(field, folder, links))
    return out


def _weight_problems(recipe, model_dir: Path | None) -> list[str]:
    """safetensors files of the base model and the adapters whose size or byte ranges disagree with their own header."""
    from .common.safetensors import damage

    out = []
    for field, folder in _input_folders(recipe, model_dir):
        for f in sorted(folder.glob("*.safetensors")) if folder.is_dir() else []:
            why = damage(f)
            if why:
                out.append(f"{field}: {f} {why}; download or copy it again, or re-save it where it was made")
    return out


def _data_problems(recipe, out: list[str]) -> tuple[list[str], list[dict] | None, list | None]:
    """Append the calibration and validation files' problems to `out`; return what of them needs a chat template, the
    validation rows and the local calibration rows."""
    from . import calibration
    from .stages import StageError
    from .stages.evaluate import load_documents, load_validation

    needs, cal_rows = [], None
    c = recipe.calibration
    local = [s for s in c.sources if s.path] if c else []
    if local:
        try:
            cal_rows, _ = calibration.select(c.model_copy(update={"sources": local}))
            if any(r.messages is not None for r in cal_rows):
                needs.append("calibration.sources (rows with `messages`)")
        except StageError as e:
            out.append(str(e))
        except OSError as e:  # e.g. no permission to read it
            out.append(f"calibration: cannot read {e.filename} ({e.strerror}); fix its permissions or the path")
    le, v = recipe.evaluation.lm_eval, recipe.evaluation.validation
    if le is not None and le.apply_chat_template:
        needs.append("evaluation.lm_eval.apply_chat_template")
    rows = None
    if v is not None:
        rows = _read("evaluation.validation.path", v.path, lambda p: load_validation(p, v.metric, v.json_schema), out)
        if rows and any("messages" in r for r in rows):
            needs.append("evaluation.validation.path (rows with `messages`)")
    f = recipe.evaluation.fidelity
    if f is not None:
        _read("evaluation.fidelity.path", f.path, load_documents, out)
    return needs, rows, cal_rows


def _read(field: str, path: str, load, out: list[str]):
    """load(path), or None with the reason it cannot be read appended to `out`."""
    from .stages import StageError

    try:
        return load(path)
    except StageError as e:
        out.append(str(e))
    except UnicodeDecodeError:
        out.append(f"{path}:{_first_bad_utf8_line(Path(path))}: not UTF-8 text; re-encode the file as UTF-8")
    except OSError as e:
        out.append(f"{field}: cannot read {path} ({e.strerror})")
    return None


def _hub_snapshot(recipe) -> Path | None:
    """The local copy of a hub model's files where the hub cache already holds its config.json (no network), else None."""
    try:
        from huggingface_hub import try_to_load_from_cache

        p = try_to_load_from_cache(recipe.base.model, "config.json", revision=recipe.base.revision)
    except Exception:  # noqa: BLE001 - no huggingface_hub, an id it refuses: nothing to read before the download
        return None
    return Path(p).parent if isinstance(p, str) else None


def _first_bad_utf8_line(p: Path) -> int:
    for n, line in enumerate(p.read_bytes().split(b"\n"), 1):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError:
            return n
    return 1


def adapter_mismatch(adapter: Path, model: Path | None) -> str | None:
    """Why a LoRA adapter does not fit the base model (its recorded base model's config, its tensor shapes), or None.
    What cannot be read here is left to the merge stage, which checks the same with the model built."""
    try:
        conf = json.loads((adapter / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return "has an adapter_config.json that is not valid JSON; re-save the adapter with peft"
    if not isinstance(conf, dict):
        return "has an adapter_config.json that is not a JSON object; re-save the adapter with peft"
    own = config_mismatch(conf, adapter / "adapter_model.safetensors")
    if own or model is None:
        return own
    ours = read_config(model)
    if ours is None:
        return None
    theirs_dir = conf.get("base_model_name_or_path")
    try:
        local = (
            isinstance(theirs_dir, str)
            and theirs_dir
            and (Path(theirs_dir) / "config.json").is_file()
            and Path(theirs_dir).resolve() != model.resolve()
        )
    except (OSError, RuntimeError):  # a name too long, a symlink loop: not a local model to compare with
        local = False
    if local:
        theirs = read_config(Path(theirs_dir)) or {}
        diff = (
            [f"model type {theirs.get('model_type')!r} vs {ours.get('model_type')!r}"]
            if theirs.get("model_type") != ours.get("model_type")
            else []
        )
        diff += architecture_differences(theirs, ours)
        if diff:
            return (
                f"was trained on {theirs_dir}, another architecture than base.model ({'; '.join(diff)}); "
                "use an adapter trained on this base model, or set base.model to the adapter's"
            )
    return _shape_mismatch(adapter / "adapter_model.safetensors", ModelShape.from_config(ours))


def config_mismatch(conf: dict, st: Path) -> str | None:
    """Why an adapter's config disagrees with itself or its tensors (not a LoRA; a rank or target modules its weights do
    not have), or None. Modules that `rank_pattern` gives their own rank are checked against it by name only."""
    kind = conf.get("peft_type", "LORA")
    if kind != "LORA":
        return (
            f"is a {kind} adapter (peft_type in adapter_config.json); quantpipe merges LoRA adapters only: "
            "train a LoRA adapter, or remove this one from adapters"
        )
    try:
        header = tensors(read_header(st))
    except (OSError, ValueError):
        return None  # a missing or damaged file is reported on its own
    r, targets, pattern = conf.get("r"), conf.get("target_modules"), conf.get("rank_pattern") or {}
    for key, info in header.items():
        m = LORA_KEY.search(key)
        shape = info.get("shape") if isinstance(info, dict) else None
        if not m or not isinstance(shape, list) or len(shape) != 2:
            continue
        module, ab = m.group(1), m.group(2)
        if isinstance(targets, list) and not any(module == t or module.endswith(f".{t}") for t in targets):
            return (
                f"has weights for {module} ({key}), which its adapter_config.json does not target (target_modules "
                f"{targets}): the config and the weights are from different adapters; re-save the adapter with peft"
            )
        rank = shape[0] if ab == "A" else shape[1]
        own_rank = isinstance(pattern, dict) and any(_names(p, module) for p in pattern)
        if isinstance(r, int) and not own_rank and rank != r:
            return (
                f"has rank {rank} in {key}, but its adapter_config.json says r: {r}: the config and the weights are "
                "from different adapters; re-save the adapter with peft"
            )
    return None


def _names(pattern: str, module: str) -> bool:
    """Whether a peft `rank_pattern` key names this module (peft's rule: the key matches the name's tail)."""
    try:
        return re.fullmatch(rf"(.*\.)?{pattern}", module) is not None
    except re.error:
        return True  # a key peft itself could not use: leave the module unchecked


def _shape_mismatch(st: Path, shape: ModelShape) -> str | None:
    """LoRA A is [r, in], B is [out, r]: compare in/out with the projections the base's config implies."""
    h, L, heads, kv, hd, inter = (
        shape.hidden,
        shape.layers,
        shape.heads,
        shape.kv_heads,
        shape.head_dim,
        shape.intermediate,
    )
    if None in (h, L, heads, kv, hd, inter):
        return None
    dims = {
        "q_proj": (h, heads * hd),
        "k_proj": (h, kv * hd),
        "v_proj": (h, kv * hd),
        "o_proj": (heads * hd, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }
    try:
        header = tensors(read_header(st))
    except (OSError, ValueError):
        return None
    for key, info in header.items():
        m = LORA_TENSOR.search(key)
        shape = info.get("shape") if isinstance(info, dict) else None
        if not m or not isinstance(shape, list) or len(shape) != 2:
            continue
        layer, proj, ab = int(m.group(1)), m.group(2), m.group(3)
        if layer >= L:
            return (
                f"has weights for layer {layer} ({key}) but base.model has {L} layers; it was trained on another model"
            )
        fan_in, fan_out = dims[proj]
        got, want = (shape[1], fan_in) if ab == "A" else (shape[0], fan_out)
        if got != want:
            return (
                f"does not fit base.model: {key} has shape {shape}, but the base's {proj} has "
                f"{'input' if ab == 'A' else 'output'} size {want}; it was trained on another model"
            )
    return None
