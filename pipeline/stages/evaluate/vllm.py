"""The vllm backend: one engine for lm-eval, the validation set and the fidelity logprobs (serve environment).

lm-eval's own vllm model is built as `lm_eval --model vllm --model_args ...` builds it, so its figures are
the CLI's; its engine then generates the validation outputs (greedy) and gives the prompt logprobs of the
fidelity tokens (the documents' windows, else the validation references; see fidelity.py). The baseline
keeps those logprobs (`fidelity_reference.json`) and an artifact's stage compares against them. vLLM returns the top VLLM_LOGPROBS logprobs per position, so the KL is over
those plus one bucket for the rest (`kl_topk`: a lower bound of the full KL); top-1 agreement and
perplexity are exact. vLLM is imported inside the functions, so this module loads in any environment.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

from .. import StageError
from .compare import Scores
from .fidelity import sequences, source, summarize
from .harness import run_lm_eval
from .validation import encode_prompt, output_text, score_validation

log = logging.getLogger(__name__)

VLLM_LOGPROBS = 20  # prompt logprobs per position for fidelity under vllm: vLLM's default max_logprobs
VLLM_ENV = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")  # recorded with the engine


def run_vllm(inp, src: Path, out: Path, tok, rows: list[dict] | None, settings: dict, baseline_eval: Path | None,
             scores: Scores, timings: dict, extra: dict) -> tuple[dict | None, dict | None, dict | None]:
    """lm-eval with its vllm model, then greedy validation and prompt logprobs through that model's engine.

    (lm-eval metrics, validation, fidelity); the engine's description and the lm_eval command go into `extra`."""
    le = inp.lm_eval
    t0 = time.perf_counter()
    lm, model_args, engine = vllm_model(src, le, inp.base.trust_remote_code, inp.artifact, inp.method, settings)
    timings["engine_start_s"] = round(time.perf_counter() - t0, 2)
    extra["engine"] = engine
    extra["lm_eval_command"] = lm_eval_command(le, model_args)
    t0 = time.perf_counter()
    lm_metrics = run_lm_eval(le, model_args, out, settings, scores, lm=lm)
    timings["lm_eval_s"] = round(time.perf_counter() - t0, 2)
    log.info("%s: lm-eval %s in %.1fs", inp.artifact, json.dumps(lm_metrics), timings["lm_eval_s"])
    validation = fidelity = None
    if rows is not None:
        from vllm import SamplingParams, TokensPrompt

        t0 = time.perf_counter()
        prompts = [TokensPrompt(prompt_token_ids=encode_prompt(tok, row, settings["add_bos"])) for row in rows]
        outs = lm.model.generate(prompts, SamplingParams(temperature=0.0, max_tokens=inp.validation.max_new_tokens), use_tqdm=False)
        texts = [output_text(tok, o.outputs[0].token_ids, inp.validation.stop) for o in outs]
        validation = score_validation(rows, texts, inp.validation, out, scores)
        timings["validation_s"] = round(time.perf_counter() - t0, 2)
        log.info("%s: validation %s", inp.artifact, json.dumps(validation))
    if rows is not None or inp.fidelity is not None:
        t0 = time.perf_counter()
        mine = prompt_logprobs(lm.model, sequences(inp, tok, rows, settings["add_bos"]))
        if baseline_eval is None:  # the baseline keeps its logprobs for the artifacts' stages
            (out / "fidelity_reference.json").write_text(json.dumps({"logprobs": VLLM_LOGPROBS, "sequences": mine}))
        else:
            try:
                ref = json.loads((Path(baseline_eval) / "fidelity_reference.json").read_text())["sequences"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise StageError(f"baseline_eval {baseline_eval}: no readable fidelity_reference.json ({e!r}); re-run evaluate:baseline with backend vllm (--force evaluate)") from None
            fidelity = summarize(fidelity_topk(ref, mine), inp.bootstrap_samples, *source(inp))
            if fidelity is not None:
                fidelity["kl_support"] = f"top-{VLLM_LOGPROBS} logprobs per position + one bucket for the rest (a lower bound of the full KL)"
            log.info("%s: fidelity vs baseline %s", inp.artifact, json.dumps(fidelity))
        timings["fidelity_s"] = round(time.perf_counter() - t0, 2)
    return lm_metrics, validation, fidelity


def vllm_model(src: Path, le, trust_remote_code: bool, artifact: str, method: str, settings: dict):
    """lm-eval's vllm model, built as `lm_eval --model vllm --model_args ...` builds it (this starts the engine).

    Refused before any engine starts when vLLM has no kernel for the checkpoint's scheme on this machine."""
    # What vLLM can run here and the CPU KV-cache size, decided as for the benchmark stage (common.vllm_support).
    # Not in this stage's cache key: they decide a refusal, never cached, and a KV-cache size, which moves no figure.
    from ...common.hf_config import text_config
    from ...common.vllm_support import (
        DEFAULT_CPU_KV_BYTES,
        kv_bytes_per_token,
        probe_platform,
        quant_scheme,
        unservable_reason,
    )

    plat = probe_platform()
    scheme = quant_scheme(src)
    reason = unservable_reason(scheme, method, plat)
    if reason:
        raise StageError(
            f"{artifact}: evaluation.lm_eval.backend vllm cannot evaluate it on this machine: {reason}. "
            "Set evaluation.lm_eval.backend: hf (transformers reads every scheme), or evaluate on a machine whose vLLM serves it"
        )
    model_args = {"pretrained": str(src), "dtype": settings["dtype"], "add_bos_token": settings["add_bos"], "seed": le.seed}
    if trust_remote_code:
        model_args["trust_remote_code"] = True
    if plat["platform"] == "cpu":
        if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            # vLLM's CPU worker needs an explicit KV-cache size: room for one sequence of the model's full length
            bpt = (kv_bytes_per_token(src, None) or 0) * (2 if settings["dtype"] == "float32" else 1)
            need = bpt * (text_config(src).get("max_position_embeddings") or 0)
            model_args["kv_cache_memory_bytes"] = max(DEFAULT_CPU_KV_BYTES, math.ceil(need / 2**20) * 2**20)
    if le.gpu_memory_utilization is not None and plat["platform"] != "cpu":
        model_args["gpu_memory_utilization"] = le.gpu_memory_utilization
    # Evaluation measures accuracy, not speed: torch.compile and CUDA-graph capture would only lengthen the
    # engine start (on the CPU 35-110 s on 2 cores; on an H200 ~45 s of a ~90 s start for an 8B model), and a
    # separate engine-core process costs one more import of vLLM (~20 s there) and a hop per request. So the
    # engine runs eager and in-process, on every platform; lm_eval_command records both.
    model_args["enforce_eager"] = True
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from lm_eval.models.vllm_causallms import VLLM

    lm = VLLM.create_from_arg_obj(model_args, {"batch_size": le.batch_size, "device": settings["device"]})
    env = {k: os.environ[k] for k in VLLM_ENV if k in os.environ}
    engine = {"model_args": {k: v for k, v in model_args.items() if k != "pretrained"}, "env": env, "platform": plat, "scheme": scheme}
    return lm, model_args, engine


def lm_eval_command(le, model_args: dict) -> str:
    """The `lm_eval` command line (with the vLLM environment variables set) that gives the same lm-eval figures."""
    cmd = [f"{k}={os.environ[k]}" for k in VLLM_ENV if k in os.environ]
    cmd += ["lm_eval", "--model", "vllm", "--model_args", ",".join(f"{k}={v}" for k, v in model_args.items()),
            "--tasks", ",".join(le.tasks), "--batch_size", str(le.batch_size), "--seed", str(le.seed)]
    if le.num_fewshot is not None:
        cmd += ["--num_fewshot", str(le.num_fewshot)]
    if le.limit is not None:
        cmd += ["--limit", str(le.limit)]
    if le.include_path:
        cmd += ["--include_path", le.include_path]
    if le.apply_chat_template:
        cmd += ["--apply_chat_template", "--fewshot_as_multiturn"]
    return " ".join(cmd)


def prompt_logprobs(llm, seqs: list[tuple[list[int], int]]) -> list[list[dict]]:
    """Per sequence (ids, first scored position), per scored token: its id and logprob, and the top logprobs of its position."""
    from vllm import SamplingParams, TokensPrompt

    if not seqs:
        return []
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=VLLM_LOGPROBS, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids, _ in seqs], params, use_tqdm=False)
    result = []
    for (ids, start), o in zip(seqs, outs):
        positions = []
        for j in range(start, len(ids)):
            d = o.prompt_logprobs[j]  # the position that predicts token j
            top = sorted(((int(t), float(lp.logprob)) for t, lp in d.items() if lp.rank is not None and lp.rank <= VLLM_LOGPROBS), key=lambda x: -x[1])
            positions.append({"target": int(ids[j]), "target_logprob": float(d[ids[j]].logprob), "top": top})
        result.append(positions)
    return result


def kl_topk(p: dict[int, float], q: dict[int, float]) -> float:
    """KL(P || Q) of two next-token distributions known by the logprobs of some tokens each.

    Tokens known on both sides count one by one, every other token goes into one `rest` bucket. Merging
    tokens never raises KL (log-sum inequality), so this is a lower bound of the full-vocabulary KL, and
    exact when the tokens known on both sides hold all the probability. The rest bucket of Q is floored
    at 1e-6 (float32 logprobs sum to 1 within about that), which keeps the bound a lower bound."""
    shared = p.keys() & q.keys()
    kl = math.fsum(math.exp(p[t]) * (p[t] - q[t]) for t in shared)
    p_rest = 1.0 - math.fsum(math.exp(p[t]) for t in shared)
    q_rest = 1.0 - math.fsum(math.exp(q[t]) for t in shared)
    if p_rest > 0 and p_rest != q_rest:
        kl += p_rest * (math.log(p_rest) - math.log(max(q_rest, 1e-6)))
    return max(kl, 0.0)


def fidelity_topk(base: list, mine: list) -> list[dict]:
    """Per sequence, the sums of KL(baseline || artifact) (over each position's top logprobs, see kl_topk), top-1 agreements
    and negative log-likelihoods of the scored tokens, with their count, from the vLLM prompt logprobs of both (top-1
    agreement and perplexity are exact); fidelity.summarize takes them."""
    if len(base) != len(mine) or any([x["target"] for x in b] != [x["target"] for x in a] for b, a in zip(base, mine)):
        raise StageError("the baseline's fidelity logprobs are for other tokens than this artifact's; re-run evaluate:baseline (--force evaluate)")
    out = []
    for b_seq, a_seq in zip(base, mine):
        kl = nll_a = nll_b = 0.0
        agree = 0
        for b, a in zip(b_seq, a_seq):
            pb = {int(t): lp for t, lp in b["top"]} | {b["target"]: b["target_logprob"]}
            pa = {int(t): lp for t, lp in a["top"]} | {a["target"]: a["target_logprob"]}
            kl += kl_topk(pb, pa)
            agree += int(b["top"][0][0] == a["top"][0][0])
            nll_b -= b["target_logprob"]
            nll_a -= a["target_logprob"]
        out.append({"kl": kl, "agree": agree, "nll": nll_a, "nll_baseline": nll_b, "n": len(b_seq)})
    return out
