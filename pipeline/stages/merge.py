"""Merge stage: fold the recipe's LoRA adapters into the base model, and prove the merge is exact. Every adapter is
checked against the base before anything heavy loads (peft type, target modules, the shapes in adapter_model.safetensors,
the architecture it was trained on), so an adapter made for another model fails with a sentence naming it instead of a
size-mismatch traceback. The merge runs in float32 with peft (`merge_and_unload`), several adapters scaled by their
`weight`, and the merged model's logits must match base + adapter (unmerged) on a few fixed prompts. Output: safetensors
in `inp.base.dtype`, tokenizer, chat template and generation config, never an adapter_config.json; without adapters the
base passes through as symlinks (no weights are copied).

    quantpipe run recipes/demo.yaml --stages merge
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from ..common.links import escape_sentence, escaping_links
from ..common.safetensors import param_count
from . import StageError
from .contract import MergeInput, Upstream
from .merge_adapters import apply_adapters, check_adapter

log = logging.getLogger(__name__)

# Merged and unmerged logits may differ by float32 rounding only: peft computes W x + s·B(A x) unmerged and (W + s·B A) x
# merged, the same sums reassociated (~1e-7 relative per layer; 4e-6 absolute measured on the tiny models, logits ~20).
# 1e-3 of the logit scale leaves three orders of margin for deep models and stays far below what a wrong merge gives
# (a dropped scale, a transposed or missing delta moves logits by the adapter's own effect, order 0.1-10).
MERGE_RTOL = 1e-3
PROBE_TEXTS = (
    "The capital of France is Paris, and the capital of Italy is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, a small robot woke up in a quiet workshop and",
)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json")


def run(inp: MergeInput, src: Path, out: Path, upstream: dict[str, Upstream] | None = None) -> dict:
    """Merge `inp.adapters` into the model in `src`, writing the merged model to `out`."""
    src, out = Path(src), Path(out)
    if (src / "adapter_config.json").is_file():
        raise StageError(
            f"base.model {src} is a LoRA adapter, not a model; set base.model to the model it was trained on "
            f"and list {src} under adapters:"
        )
    if not (src / "config.json").is_file():
        raise StageError(f"base.model {src} has no config.json; point base.model at a Hugging Face model directory")
    _refuse_escaping_links(inp, src)
    if not inp.adapters:
        return _pass_through(inp, src, out)

    import torch
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(src, trust_remote_code=inp.base.trust_remote_code)
    tok_src = _tokenizer_source(inp, src)
    tokenizer = _load_tokenizer(tok_src, inp)
    vocab = cfg.get_text_config().vocab_size
    if tokenizer is not None and tok_src != src:  # an adapter that ships its own tokenizer may have added tokens
        vocab = max(vocab, len(tokenizer))
    adapters = [check_adapter(i, a.path, a.weight, inp, src, cfg, vocab) for i, a in enumerate(inp.adapters)]

    model = _load_base(inp, src)
    if vocab > model.get_input_embeddings().weight.shape[0]:
        # The adapter's tokenizer added tokens (and the adapter carries the resized embeddings).
        model.resize_token_embeddings(vocab)
    probes = _probe_ids(tokenizer, model.config)
    base_logits = _logits(model, probes)

    peft_model = apply_adapters(model, adapters)
    unmerged = _logits(peft_model, probes)
    merged = peft_model.merge_and_unload(safe_merge=True, adapter_names=[a["name"] for a in adapters])
    merged_logits = _logits(merged, probes)

    scale = max(max(t.abs().max().item() for t in unmerged), 1.0)
    diff = max((u - m).abs().max().item() for u, m in zip(unmerged, merged_logits))
    shift = max((u - b).abs().max().item() for u, b in zip(unmerged, base_logits))
    if not diff <= MERGE_RTOL * scale:  # also catches NaN
        raise StageError(
            f"the merged model does not reproduce base + adapter: logits differ by {diff:.3g} (tolerance "
            f"{MERGE_RTOL * scale:.3g}); the adapter type or its target modules are not merged correctly by peft "
            f"{_version('peft')}. Check the adapters' adapter_config.json (use_dora, fan_in_fan_out, modules_to_save)."
        )
    if any(k.startswith(("base_model", "peft")) or "lora_" in k for k in merged.state_dict()):
        raise StageError(
            "the merged model still holds LoRA weights after merge_and_unload; this peft version cannot merge these adapters"
        )

    dtype = getattr(torch, inp.base.dtype)
    merged = merged.to(dtype)
    merged.config.dtype = dtype
    merged.save_pretrained(out, max_shard_size="5GB")
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    _copy_chat_template(tok_src, out)
    leaked = [p.name for p in out.iterdir() if p.name.startswith("adapter_") or p.suffix in PICKLE_SUFFIXES]
    if leaked:
        raise StageError(
            f"merge wrote {', '.join(leaked)} into the merged model; this is a bug in quantpipe's merge stage"
        )

    metrics = {
        "n_adapters": len(adapters),
        "merge_max_abs_diff": diff,
        "merge_tolerance": MERGE_RTOL * scale,
        "adapter_logit_shift": shift,
        "params": sum(p.numel() for p in merged.parameters()),
        "size_bytes": sum(p.stat().st_size for p in out.glob("*.safetensors")),
        "dtype": inp.base.dtype,
        "adapters": [
            {k: a[k] for k in ("path", "weight", "r", "lora_alpha", "target_modules", "base_model_name_or_path")}
            for a in adapters
        ],
        "tokenizer_from": str(tok_src),
    }
    if shift < 1e-6:
        metrics["status_note"] = "the adapters do not change the logits (untrained or zero-weight adapters?)"
    log.info("merged %d adapter(s): max |merged - unmerged| = %.3g, adapter shift %.3g", len(adapters), diff, shift)
    return metrics


def _refuse_escaping_links(inp: MergeInput, src: Path) -> None:
    """No file from outside the base or an adapter folder reaches the cache (as a copy, or as a pass-through link)."""
    folders = [("base.model", src)] + [(f"adapters.{i}.path", Path(a.path)) for i, a in enumerate(inp.adapters)]
    for field, folder in folders:
        links = escaping_links(folder)
        if links:
            raise StageError(escape_sentence(field, folder, links))


# --- pass-through ---------------------------------------------------------------------------


def _pass_through(inp: MergeInput, src: Path, out: Path) -> dict:
    """No adapters: `out` mirrors `src` with absolute symlinks, so no weights are copied."""
    has_st = any(src.glob("*.safetensors"))
    n = 0
    for root, dirs, files in os.walk(src):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        rel = Path(root).relative_to(src)
        for f in sorted(files):
            if f.startswith(".") or (f.endswith(PICKLE_SUFFIXES) and (has_st or not inp.base.allow_pickle)):
                continue
            (out / rel).mkdir(parents=True, exist_ok=True)
            os.symlink(os.path.realpath(Path(root) / f), out / rel / f)
            n += 1
    weights = sorted(out.glob("*.safetensors"))
    if not weights and not inp.base.allow_pickle:
        raise StageError(
            f"base.model {src} holds no *.safetensors weights; convert them, or set base.allow_pickle: true if you trust its .bin files"
        )
    cfg = json.loads((src / "config.json").read_text())
    text_cfg = cfg.get("text_config", cfg)
    return {
        "n_adapters": 0,
        "merge_max_abs_diff": None,
        "adapter_logit_shift": None,
        "params": param_count(weights),
        "size_bytes": sum(p.stat().st_size for p in weights),
        "dtype": cfg.get("dtype") or cfg.get("torch_dtype") or text_cfg.get("dtype") or text_cfg.get("torch_dtype"),
        "linked_files": n,
        "status_note": "no adapters: base passed through (symlinks)",
    }


# --- helpers --------------------------------------------------------------------------------


def _load_base(inp: MergeInput, src: Path):
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": torch.float32, "trust_remote_code": inp.base.trust_remote_code}
    if not inp.base.allow_pickle:
        kwargs["use_safetensors"] = True
    try:
        model = AutoModelForCausalLM.from_pretrained(src, **kwargs)
    except (OSError, ValueError) as e:
        raise StageError(f"base.model {src} cannot be loaded: {str(e).splitlines()[0][:300]}") from None
    return model.eval()


def _tokenizer_source(inp: MergeInput, src: Path) -> Path:
    """The last adapter that ships a tokenizer (it may add tokens or a chat template), else the base."""
    for a in reversed(inp.adapters):
        if any((Path(a.path) / f).is_file() for f in TOKENIZER_FILES):
            return Path(a.path)
    return src


def _load_tokenizer(path: Path, inp: MergeInput):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=inp.base.trust_remote_code)
    except (OSError, ValueError, TypeError) as e:
        log.warning("no usable tokenizer in %s (%s); the merged model is saved without one", path, e)
        return None


def _copy_chat_template(tok_src: Path, out: Path) -> None:
    """Keep a chat template the tokenizer did not write itself (e.g. a separate chat_template.json)."""
    import shutil

    for name in ("chat_template.jinja", "chat_template.json"):
        if (tok_src / name).is_file() and not (out / name).exists():
            shutil.copyfile(tok_src / name, out / name)


def _probe_ids(tokenizer, config) -> list[list[int]]:
    """A few fixed prompts (one through the chat template where there is one), as token ids."""
    vocab = config.get_text_config().vocab_size
    if tokenizer is None:
        return [[(17 * i + 3) % vocab for i in range(n)] for n in (12, 24, 36)]
    texts = list(PROBE_TEXTS)
    if getattr(tokenizer, "chat_template", None):
        try:
            texts.append(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": "What is the capital of France?"}],
                    tokenize=False,
                    add_generation_prompt=True,
                )
            )
        except Exception as e:  # a template that needs other roles or fields: the plain prompts suffice
            log.info("chat template not used for the merge check: %s", e)
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"][:64] for t in texts]
    return [i for i in ids if i]


def _logits(model, probes: list[list[int]]):
    import torch

    with torch.no_grad():
        return [model(input_ids=torch.tensor([ids])).logits[0].float() for ids in probes]


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"
