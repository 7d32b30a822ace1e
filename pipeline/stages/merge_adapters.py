"""The merge stage's LoRA adapters: each one is checked against the base model before anything heavy loads (peft type,
the architecture it was trained on, the shape of every tensor in adapter_model.safetensors against the module it
patches, on an empty-weight copy of the base), then all are loaded into one peft model and scaled by their `weight`.
An adapter made for another model fails here with a sentence naming it, not with peft's size-mismatch traceback.
`quantpipe.stages.merge` calls `check_adapter` per adapter and `apply_adapters` once.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..common.shape import KEYS, architecture_differences
from . import StageError
from .contract import MergeInput


def check_adapter(i: int, path: str, weight: float, inp: MergeInput, src: Path, cfg, vocab: int) -> dict:
    """Read an adapter's config and tensor shapes and check them against the base, before loading."""
    p = Path(path)
    where = f"adapters[{i}] ({p})"
    conf_path = p / "adapter_config.json"
    if not conf_path.is_file():
        raise StageError(
            f"{where} has no adapter_config.json; point adapters[{i}].path at a PEFT LoRA adapter directory"
        )
    try:
        conf = json.loads(conf_path.read_text())
    except json.JSONDecodeError as e:
        raise StageError(
            f"{where}: adapter_config.json is not valid JSON ({e}); re-save the adapter with peft"
        ) from None
    if conf.get("peft_type", "LORA") != "LORA":
        raise StageError(
            f"{where} is a {conf.get('peft_type')} adapter; quantpipe merges LoRA adapters only (peft_type LORA)"
        )
    st = p / "adapter_model.safetensors"
    if not st.is_file():
        if (p / "adapter_model.bin").is_file() and not inp.base.allow_pickle:
            raise StageError(
                f"{where} has only a pickle adapter_model.bin; convert it to safetensors or set base.allow_pickle: true if you trust it"
            )
        if not (p / "adapter_model.bin").is_file():
            raise StageError(f"{where} has no adapter_model.safetensors")

    base_name = conf.get("base_model_name_or_path")
    _check_architecture(where, base_name, src, cfg)
    if st.is_file():
        _check_shapes(where, st, inp, cfg, vocab)
    return {
        "name": f"adapter_{i}",
        "path": str(p),
        "weight": weight,
        "r": conf.get("r"),
        "lora_alpha": conf.get("lora_alpha"),
        "target_modules": conf.get("target_modules"),
        "base_model_name_or_path": base_name,
    }


def _check_architecture(where: str, base_name: str | None, src: Path, cfg) -> None:
    """Where the adapter names a local base model, it must be the same architecture as ours."""
    if not base_name or not (Path(base_name) / "config.json").is_file():
        return  # a hub id or nothing: the shape check below is all we can do offline
    if Path(base_name).resolve() == src.resolve():
        return
    theirs = json.loads((Path(base_name) / "config.json").read_text())
    ours = cfg.to_dict()
    problems = []
    if theirs.get("model_type") != ours.get("model_type"):
        problems.append(f"model type {theirs.get('model_type')!r} vs {ours.get('model_type')!r}")
    problems += architecture_differences(theirs, ours)
    if problems:
        arch = (theirs.get("architectures") or [theirs.get("model_type")])[0]
        raise StageError(
            f"{where} was trained on {base_name} ({arch}), which differs from base.model {src} "
            f"({'; '.join(problems)}); set base.model to the model the adapter was trained on, or use an adapter trained on this base"
        )


LORA_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<kind>lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)(?:\.[^.]+)?(?:\.weight)?$"
)


def _check_shapes(where: str, st: Path, inp: MergeInput, cfg, vocab: int) -> None:
    """Every tensor in adapter_model.safetensors must fit a module of the base model."""
    import torch
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        try:
            meta = AutoModelForCausalLM.from_config(cfg, trust_remote_code=inp.base.trust_remote_code)
        except ValueError as e:
            raise StageError(
                f"base.model: transformers cannot build this architecture ({e}); set base.trust_remote_code: true if the model ships its own code and you trust it"
            ) from None
    if vocab > meta.get_input_embeddings().weight.shape[0]:
        meta.resize_token_embeddings(vocab)
    modules = dict(meta.named_modules())
    params = dict(meta.named_parameters())
    wrong: list[str] = []
    missing: list[str] = []
    with safe_open(st, framework="pt") as f:
        for key in f.keys():
            shape = tuple(f.get_slice(key).get_shape())
            m = LORA_KEY.match(key)
            if m is None:  # modules_to_save: full tensors that replace the base's
                name = key.removeprefix("base_model.model.")
                if name not in params:
                    missing.append(name)
                elif tuple(params[name].shape) != shape:
                    wrong.append(f"{name}: adapter {list(shape)} vs base {list(params[name].shape)}")
                continue
            mod = modules.get(m["module"])
            if mod is None:
                missing.append(m["module"])
                continue
            w = getattr(mod, "weight", None)
            if w is None:
                continue
            if isinstance(mod, torch.nn.Embedding):
                n_in, n_out = mod.num_embeddings, mod.embedding_dim
            elif hasattr(mod, "in_features"):
                n_in, n_out = mod.in_features, mod.out_features
            elif w.dim() == 2:  # Conv1D-style (in, out)
                n_in, n_out = w.shape[0], w.shape[1]
            else:
                continue
            kind = m["kind"]
            ok = (
                (kind in ("lora_A",) and shape[-1] == n_in)
                or (kind == "lora_B" and shape[0] == n_out)
                or (kind == "lora_embedding_A" and shape[-1] == n_in)
                or (kind == "lora_embedding_B" and shape[0] == n_out)
                or (kind == "lora_magnitude_vector" and shape[0] == n_out)
            )
            if not ok:
                wrong.append(f"{m['module']}.{kind}: adapter {list(shape)} vs base layer in={n_in} out={n_out}")
    if missing or wrong:
        arch = (cfg.architectures or [cfg.model_type])[0]
        detail = "; ".join(
            ([f"modules missing in the base: {', '.join(sorted(set(missing))[:4])}"] if missing else []) + wrong[:3]
        )
        hidden = getattr(cfg.get_text_config(), KEYS["hidden"], "?")
        raise StageError(
            f"{where} does not fit base.model ({arch}, hidden_size {hidden}): {detail}. "
            "It was trained for a different model; set base.model to the model it was trained on, or use an adapter trained on this base"
        )


def apply_adapters(model, adapters: list[dict]):
    """Load every adapter into one peft model, scale each by its weight, and activate them all."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    peft_model = None
    for a in adapters:
        try:
            if peft_model is None:
                peft_model = PeftModel.from_pretrained(model, a["path"], adapter_name=a["name"])
            else:
                peft_model.load_adapter(a["path"], adapter_name=a["name"])
        except (RuntimeError, ValueError, KeyError) as e:
            msg = str(e).strip().splitlines()
            hint = (
                "it was trained for a different model"
                if "size mismatch" in str(e) or "not found" in str(e)
                else "peft cannot load it"
            )
            raise StageError(
                f"adapter {a['path']} cannot be applied to base.model: {hint} ({msg[0][:300] if msg else type(e).__name__}). "
                "Set base.model to the model it was trained on, or use an adapter trained on this base"
            ) from None
        if a["weight"] != 1.0:
            for module in peft_model.modules():
                if isinstance(module, LoraLayer) and a["name"] in module.scaling:
                    module.scaling[a["name"]] *= a["weight"]
    peft_model.base_model.set_adapter([a["name"] for a in adapters])
    peft_model.eval()
    return peft_model
