"""The hf backend: lm-eval's hf model, then greedy validation and full-vocabulary fidelity through transformers, which
reads every artifact (it decompresses compressed-tensors), so this backend evaluates any scheme on any machine. The
baseline's stage keeps the input of its output layer for the fidelity tokens (`fidelity_hidden.safetensors`), so an
artifact's stage computes the baseline's logits with that one layer instead of a whole forward pass; a model whose
logits are not that layer's output (e.g. with logit soft-capping) keeps no such file, and an artifact's stage then runs
the baseline's forward pass itself."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from ...cache import hash_json
from .. import StageError
from .compare import Scores
from .fidelity import sequences, source, summarize
from .harness import hf_model_args, run_lm_eval
from .validation import encode_prompt, output_text, score_validation

log = logging.getLogger(__name__)


def run_hf(
    inp,
    src: Path,
    out: Path,
    tok,
    rows: list[dict] | None,
    settings: dict,
    baseline_model: Path | None,
    baseline_eval: Path | None,
    scores: Scores,
    timings: dict,
) -> tuple[dict | None, dict | None, dict | None]:
    """(lm-eval metrics, validation, fidelity) of the model in `src`; fidelity only for an artifact (`baseline_model` given),
    the baseline keeps the hidden states its artifacts' fidelity needs."""
    lm_metrics = validation = fidelity = None
    if inp.lm_eval:
        t0 = time.perf_counter()
        lm_metrics = run_lm_eval(
            inp.lm_eval, hf_model_args(src, settings, inp.base.trust_remote_code), out, settings, scores
        )
        timings["lm_eval_s"] = round(time.perf_counter() - t0, 2)
        free()  # lm-eval's model copy, before the next one loads
        log.info("%s: lm-eval %s in %.1fs", inp.artifact, json.dumps(lm_metrics), timings["lm_eval_s"])
    fidelity_seqs = None
    if inp.fidelity is not None or rows is not None:
        fidelity_seqs = sequences(
            inp, tok, rows, settings["add_bos"]
        )  # before any model loads: a short text fails fast
    if rows is None and fidelity_seqs is None:
        return lm_metrics, validation, fidelity
    model = load_model(src, settings["dtype"], inp.base.trust_remote_code, settings["device"])
    if rows is not None:
        t0 = time.perf_counter()
        texts = generate(model, tok, rows, inp.validation, settings)
        validation = score_validation(rows, texts, inp.validation, out, scores)
        timings["validation_s"] = round(time.perf_counter() - t0, 2)
        log.info("%s: validation %s", inp.artifact, json.dumps(validation))
    if baseline_model is None:  # the baseline: keep what its artifacts' fidelity needs
        if fidelity_seqs:
            t0 = time.perf_counter()
            save_reference(model, fidelity_seqs, out / REFERENCE)
            timings["fidelity_reference_s"] = round(time.perf_counter() - t0, 2)
    elif fidelity_seqs is not None:
        t0 = time.perf_counter()
        kept = load_reference(Path(baseline_eval) / REFERENCE, fidelity_seqs) if baseline_eval else None
        head = (
            load_head(baseline_model, settings["dtype"], inp.base.trust_remote_code, settings["device"], kept)
            if kept
            else None
        )
        ref = (
            head
            if head is not None
            else load_model(baseline_model, settings["dtype"], inp.base.trust_remote_code, settings["device"])
        )
        hidden = kept.states if kept else None
        fidelity = summarize(fidelity_full(ref, model, fidelity_seqs, hidden), inp.bootstrap_samples, *source(inp))
        if fidelity is not None:
            fidelity["kl_support"] = "full vocabulary"
            fidelity["baseline_logits"] = (
                "baseline forward pass"
                if not kept
                else "from the baseline stage's hidden states" + (" and its output layer alone" if head else "")
            )
        timings["fidelity_s"] = round(time.perf_counter() - t0, 2)
        del ref
        log.info("%s: fidelity vs baseline %s", inp.artifact, json.dumps(fidelity))
    del model
    free()
    return lm_metrics, validation, fidelity


def free() -> None:
    """Give back the memory of the models dropped so far (and CUDA's cached blocks)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def load_model(path: Path, dtype: str, trust_remote_code: bool, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as e:
        raise StageError(f"{path}: cannot load the model with transformers ({str(e)[:300]})") from None
    return model.to(device).eval()


def generate(model, tok, rows: list[dict], cfg, settings: dict) -> list[str]:
    """Greedy generation with transformers (left-padded batches, longest prompts first); outputs cut at the stop strings."""
    import torch

    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    prompts = [encode_prompt(tok, row, settings["add_bos"]) for row in rows]
    order = sorted(range(len(rows)), key=lambda i: (-len(prompts[i]), i))
    bs = settings["validation"]["batch_size"]
    texts: list[str] = [""] * len(rows)
    with torch.inference_mode():
        for start in range(0, len(order), bs):
            batch = order[start : start + bs]
            width = max(len(prompts[i]) for i in batch)
            x = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in batch], device=model.device)
            mask = torch.tensor(
                [[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in batch], device=model.device
            )
            gen = model.generate(
                x,
                attention_mask=mask,
                max_new_tokens=cfg.max_new_tokens,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                pad_token_id=pad,
            )
            for j, i in enumerate(batch):
                texts[i] = output_text(tok, gen[j, width:], cfg.stop)
    return texts


def fidelity_full(ref_model, model, seqs: list[tuple[list[int], int]], hidden: list | None = None) -> list[dict]:
    """Per sequence (ids, first scored position): the sums of KL(baseline || artifact) over the whole vocabulary, top-1
    agreements and negative log-likelihoods of the scored tokens, with their count. `hidden`: per sequence, the input of
    the baseline's output layer (load_reference), `ref_model` then possibly that layer alone; None: a full forward pass."""
    import torch

    out = []
    head = (
        None
        if hidden is None
        else ref_model
        if isinstance(ref_model, torch.nn.Linear)
        else ref_model.get_output_embeddings()
    )
    with torch.inference_mode():
        for i, (ids, start) in enumerate(seqs):
            x = torch.tensor([ids], device=model.device)
            sl = slice(start - 1, len(ids) - 1)  # positions that predict the scored tokens
            ref_logits = ref_model(x).logits if hidden is None else head(hidden[i].to(model.device))
            lb = torch.log_softmax(ref_logits[0, sl].float(), dim=-1)
            la = torch.log_softmax(model(x).logits[0, sl].float(), dim=-1)
            target = torch.tensor(ids[start:], device=model.device)[:, None]
            out.append(
                {
                    "kl": float((lb.exp() * (lb - la)).sum(dim=-1).clamp_min(0).sum()),
                    "agree": int((lb.argmax(-1) == la.argmax(-1)).sum()),
                    "nll": -float(la.gather(1, target).sum()),
                    "nll_baseline": -float(lb.gather(1, target).sum()),
                    "n": len(ids) - start,
                }
            )
    return out


REFERENCE = "fidelity_hidden.safetensors"


@dataclass
class Kept:
    """What the baseline's stage kept: per sequence, the input of its output layer; and the SHA-256 of the first
    sequence's logits, against which a rebuilt output layer is checked."""

    states: list
    logits_sha256: str | None


def logits_digest(logits) -> str:
    import hashlib

    return hashlib.sha256(logits.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()


def save_reference(model, seqs: list[tuple[list[int], int]], path: Path) -> None:
    """Keep, per sequence, the input of the model's output layer, when that layer alone gives the model's logits (checked
    on the first sequence, bit for bit); an artifact's stage then needs no forward pass of the baseline."""
    import torch
    from safetensors.torch import save_file

    head = model.get_output_embeddings()
    if head is None:
        return
    captured: list = []
    hook = head.register_forward_pre_hook(lambda _m, args: captured.append(args[0].detach().clone()))
    tensors, digest = {}, None
    try:
        with torch.inference_mode():
            for i, (ids, _) in enumerate(seqs):
                logits = model(torch.tensor([ids], device=model.device)).logits
                h = captured.pop()
                if i == 0:
                    if not torch.equal(head(h), logits):
                        log.info(
                            "the baseline's logits are not its output layer's alone: artifacts run the baseline's forward pass"
                        )
                        return
                    digest = logits_digest(logits)
                tensors[str(i)] = h.cpu().contiguous()
    finally:
        hook.remove()
    save_file(tensors, str(path), metadata={"sequences_sha256": hash_json(seqs), "logits0_sha256": digest or ""})


def load_reference(path: Path, seqs: list[tuple[list[int], int]]) -> Kept | None:
    """The baseline's hidden states for `seqs` (save_reference), or None when it kept none for exactly these sequences."""
    from safetensors import safe_open

    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("sequences_sha256") != hash_json(seqs) or len(f.keys()) != len(seqs):
            return None
        # fresh, aligned copies: the matmul then rounds as on the original
        return Kept([f.get_tensor(str(i)).clone() for i in range(len(seqs))], meta.get("logits0_sha256") or None)


def load_head(path: Path, dtype: str, trust_remote_code: bool, device: str, kept: Kept):
    """The baseline's output layer alone, its weight from the checkpoint (the input embeddings' where tied), when it gives
    the baseline stage's first-sequence logits bit for bit; None otherwise (a bias, another layout, another device's rounding)."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    if not kept.logits_sha256:
        return None
    try:
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(
                config, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code
            )
    except (OSError, ValueError, TypeError) as e:
        log.info("the baseline's output layer alone: %s; loading the whole model", str(e)[:200])
        return None
    head = skeleton.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return None
    tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
    source = skeleton.get_input_embeddings() if tied else head
    key = next((f"{n}.weight" for n, m in skeleton.named_modules() if m is source), None)
    weight = None
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            if key in st.keys():
                weight = st.get_tensor(key)
                break
    if weight is None or tuple(weight.shape) != tuple(head.weight.shape):
        return None
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = torch.nn.Parameter(weight.to(getattr(torch, dtype)).to(device).contiguous(), requires_grad=False)
    with torch.inference_mode():
        same = logits_digest(layer(kept.states[0].to(device))) == kept.logits_sha256
    if not same:
        log.info("the baseline's output layer alone does not give its logits bit for bit here; loading the whole model")
        return None
    return layer.eval()
