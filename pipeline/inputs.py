"""The data a recipe names, read before anything runs: calibration and validation rows, adapters against the base.

`recipe.load` checks that the files exist; this reads them as the stages will, without torch, so a
bad row or an adapter trained on another model is bad input (exit 2, the file and line named) in
`quantpipe check` and before `quantpipe run` writes anything, not a stage failure an hour in:

    from quantpipe.inputs import problems
    problems(recipe)   # -> [] or ["data/val.jsonl:7: `reference` must be a non-empty string (metric exact_match)", ...]
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

ARCH_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")
LORA_TENSOR = re.compile(r"layers\.(\d+)\..*?\b(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_(A|B)\b")


def problems(recipe) -> list[str]:
    """Every problem found in the recipe's local calibration, validation and adapter files."""
    from . import calibration
    from .stages import StageError
    from .stages.evaluate import load_validation

    try:
        out = calibration.check(recipe.calibration)
    except OSError as e:  # e.g. no permission to read it
        out = [f"calibration: cannot read {e.filename} ({e.strerror}); fix its permissions or the path"]
    v = recipe.evaluation.validation
    if v is not None:
        try:
            load_validation(v.path, v.metric, v.json_schema)
        except StageError as e:
            out.append(str(e))
        except UnicodeDecodeError:
            out.append(f"{v.path}:{_first_bad_utf8_line(Path(v.path))}: not UTF-8 text; re-encode the file as UTF-8")
        except OSError as e:
            out.append(f"evaluation.validation.path: cannot read {v.path} ({e.strerror})")
    if recipe.base.is_local:
        for i, a in enumerate(recipe.adapters):
            msg = adapter_mismatch(Path(a.path), Path(recipe.base.model))
            if msg:
                out.append(f"adapters.{i}.path: {a.path} {msg}")
    return out


def _first_bad_utf8_line(p: Path) -> int:
    for n, line in enumerate(p.read_bytes().split(b"\n"), 1):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError:
            return n
    return 1


def _config(d: Path) -> dict | None:
    try:
        c = json.loads((d / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return c if isinstance(c, dict) else None


def adapter_mismatch(adapter: Path, model: Path) -> str | None:
    """Why a LoRA adapter does not fit the base model (its recorded base model's config, its tensor shapes), or None.
    What cannot be read here is left to the merge stage, which checks the same with the model built."""
    try:
        conf = json.loads((adapter / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return "has an adapter_config.json that is not valid JSON; re-save the adapter with peft"
    if not isinstance(conf, dict):
        return "has an adapter_config.json that is not a JSON object; re-save the adapter with peft"
    ours = _config(model)
    if ours is None:
        return None
    o = ours.get("text_config") if isinstance(ours.get("text_config"), dict) else ours
    theirs_dir = conf.get("base_model_name_or_path")
    try:
        local = isinstance(theirs_dir, str) and theirs_dir and (Path(theirs_dir) / "config.json").is_file() and Path(theirs_dir).resolve() != model.resolve()
    except (OSError, RuntimeError):  # a name too long, a symlink loop: not a local model to compare with
        local = False
    if local:
        theirs = _config(Path(theirs_dir)) or {}
        t = theirs.get("text_config") if isinstance(theirs.get("text_config"), dict) else theirs
        diff = [f"model type {theirs.get('model_type')!r} vs {ours.get('model_type')!r}"] if theirs.get("model_type") != ours.get("model_type") else []
        diff += [f"{k} {t[k]} vs {o[k]}" for k in ARCH_FIELDS if k in t and k in o and t[k] != o[k]]
        if diff:
            return (f"was trained on {theirs_dir}, another architecture than base.model ({'; '.join(diff)}); "
                    "use an adapter trained on this base model, or set base.model to the adapter's")
    return _shape_mismatch(adapter / "adapter_model.safetensors", o)


def _shape_mismatch(st: Path, c: dict) -> str | None:
    """LoRA A is [r, in], B is [out, r]: compare in/out with the projections the base's config implies."""
    try:
        h, L, heads, inter = (int(c[k]) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"))
        kv = int(c.get("num_key_value_heads") or heads)
        hd = int(c.get("head_dim") or h // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    dims = {"q_proj": (h, heads * hd), "k_proj": (h, kv * hd), "v_proj": (h, kv * hd), "o_proj": (heads * hd, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    try:
        with open(st, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n)) if 0 < n < 100 * 2**20 else {}
    except (OSError, ValueError, struct.error):
        return None
    for key, info in header.items() if isinstance(header, dict) else ():
        m = LORA_TENSOR.search(key)
        shape = info.get("shape") if isinstance(info, dict) else None
        if not m or not isinstance(shape, list) or len(shape) != 2:
            continue
        layer, proj, ab = int(m.group(1)), m.group(2), m.group(3)
        if layer >= L:
            return f"has weights for layer {layer} ({key}) but base.model has {L} layers; it was trained on another model"
        fan_in, fan_out = dims[proj]
        got, want = (shape[1], fan_in) if ab == "A" else (shape[0], fan_out)
        if got != want:
            return (f"does not fit base.model: {key} has shape {shape}, but the base's {proj} has "
                    f"{'input' if ab == 'A' else 'output'} size {want}; it was trained on another model")
    return None
