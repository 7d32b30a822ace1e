"""The hf backend: lm-eval's hf model, then greedy validation and full-vocabulary fidelity through transformers.

transformers reads every artifact (it decompresses compressed-tensors), so this backend evaluates any
scheme on any machine. For an artifact, the baseline model is loaded next to it and both score the same
tokens (the fidelity documents' windows, else the validation references; see fidelity.py): KL over the
whole vocabulary, top-1 agreement, perplexity, each with a 95% interval by a bootstrap over sequences.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from .. import StageError
from .compare import Scores
from .fidelity import sequences, source, summarize
from .harness import hf_model_args, run_lm_eval
from .validation import encode_prompt, output_text, score_validation

log = logging.getLogger(__name__)


def run_hf(inp, src: Path, out: Path, tok, rows: list[dict] | None, settings: dict, baseline_model: Path | None,
           scores: Scores, timings: dict) -> tuple[dict | None, dict | None, dict | None]:
    """(lm-eval metrics, validation, fidelity) of the model in `src`; fidelity only for an artifact (`baseline_model` given)."""
    lm_metrics = validation = fidelity = None
    if inp.lm_eval:
        t0 = time.perf_counter()
        lm_metrics = run_lm_eval(inp.lm_eval, hf_model_args(src, settings, inp.base.trust_remote_code), out, settings, scores)
        timings["lm_eval_s"] = round(time.perf_counter() - t0, 2)
        free()  # lm-eval's model copy, before the next one loads
        log.info("%s: lm-eval %s in %.1fs", inp.artifact, json.dumps(lm_metrics), timings["lm_eval_s"])
    fidelity_seqs = None
    if baseline_model is not None and (inp.fidelity is not None or rows is not None):
        fidelity_seqs = sequences(inp, tok, rows, settings["add_bos"])  # before any model loads: a short text fails fast
    if rows is None and fidelity_seqs is None:
        return lm_metrics, validation, fidelity
    model = load_model(src, settings["dtype"], inp.base.trust_remote_code, settings["device"])
    if rows is not None:
        t0 = time.perf_counter()
        texts = generate(model, tok, rows, inp.validation, settings)
        validation = score_validation(rows, texts, inp.validation, out, scores)
        timings["validation_s"] = round(time.perf_counter() - t0, 2)
        log.info("%s: validation %s", inp.artifact, json.dumps(validation))
    if fidelity_seqs is not None:
        t0 = time.perf_counter()
        ref_model = load_model(baseline_model, settings["dtype"], inp.base.trust_remote_code, settings["device"])
        fidelity = summarize(fidelity_full(ref_model, model, fidelity_seqs), inp.bootstrap_samples, *source(inp))
        if fidelity is not None:
            fidelity["kl_support"] = "full vocabulary"
        timings["fidelity_s"] = round(time.perf_counter() - t0, 2)
        del ref_model
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
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code)
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
            batch = order[start:start + bs]
            width = max(len(prompts[i]) for i in batch)
            x = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in batch], device=model.device)
            mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in batch], device=model.device)
            gen = model.generate(
                x, attention_mask=mask, max_new_tokens=cfg.max_new_tokens, do_sample=False,
                temperature=None, top_p=None, top_k=None, pad_token_id=pad,
            )
            for j, i in enumerate(batch):
                texts[i] = output_text(tok, gen[j, width:], cfg.stop)
    return texts


def fidelity_full(ref_model, model, seqs: list[tuple[list[int], int]]) -> list[dict]:
    """Per sequence (ids, first scored position): the sums of KL(baseline || artifact) over the whole vocabulary, top-1
    agreements and negative log-likelihoods of the scored tokens, with their count (fidelity.summarize takes them)."""
    import torch

    out = []
    with torch.inference_mode():
        for ids, start in seqs:
            x = torch.tensor([ids], device=model.device)
            sl = slice(start - 1, len(ids) - 1)  # positions that predict the scored tokens
            lb = torch.log_softmax(ref_model(x).logits[0, sl].float(), dim=-1)
            la = torch.log_softmax(model(x).logits[0, sl].float(), dim=-1)
            target = torch.tensor(ids[start:], device=model.device)[:, None]
            out.append({"kl": float((lb.exp() * (lb - la)).sum(dim=-1).clamp_min(0).sum()), "agree": int((lb.argmax(-1) == la.argmax(-1)).sum()),
                        "nll": -float(la.gather(1, target).sum()), "nll_baseline": -float(lb.gather(1, target).sum()), "n": len(ids) - start})
    return out
