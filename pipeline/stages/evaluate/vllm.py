"""The vllm backend: lm-eval, the validation set and the fidelity logprobs through one vLLM server's OpenAI-compatible
API, as a user's client would reach the model. The server is the benchmark stage's when the runner packs an artifact's
evaluation and benchmark into one job (one engine start per artifact; the evaluation runs before the measured sweep),
else one this stage starts: eager (it measures accuracy, not speed), the model's full context, on CPU a KV cache that
holds one such sequence. lm-eval's `local-completions` figures (`lm_eval_command`) equal those of `lm_eval --model vllm`
up to the order in which vLLM batches requests (tests/test_evaluate.py compares both). vLLM returns the top
VLLM_LOGPROBS logprobs per position, so the KL is a lower bound (`kl_topk`); top-1 agreement and perplexity are exact.
The baseline keeps its logprobs in `fidelity_reference.json`. vLLM is never imported here, so this module loads in any
environment."""

from __future__ import annotations

import json
import logging
import math
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .. import HostFault, StageError
from .compare import Scores
from .fidelity import sequences, source, summarize
from .harness import run_lm_eval
from .validation import encode_prompt, output_text, score_validation

log = logging.getLogger(__name__)

VLLM_LOGPROBS = 20  # prompt logprobs per position for fidelity under vllm: vLLM's default max_logprobs
CONCURRENT = 8  # requests in flight: enough to keep vLLM's batches full, few enough for a 2-core host
REQUEST_TIMEOUT_S = 600


def run_vllm(
    inp,
    src: Path,
    out: Path,
    tok,
    rows: list[dict] | None,
    settings: dict,
    baseline_eval: Path | None,
    scores: Scores,
    timings: dict,
    extra: dict,
    server=None,
) -> tuple[dict | None, dict | None, dict | None]:
    """lm-eval, greedy validation and prompt logprobs through `server` (a quantpipe.server.Server that is up), or
    through a server this stage starts. (lm-eval metrics, validation, fidelity); the engine and the lm_eval command go into `extra`."""
    if server is not None:
        timings["engine_start_s"] = 0.0
        extra["engine"] = {"shared": True, "serve_command": serve_command(server)}
        return _evaluate(server, inp, src, out, tok, rows, settings, baseline_eval, scores, timings, extra)
    from ...server import Server, ServerDied
    from ...server_output import fault_cause

    flags, engine = own_engine(src, inp.base.trust_remote_code, inp.artifact, inp.method, settings, inp.lm_eval)
    srv = Server(
        src,
        flags,
        log_path=out / "server.log",
        served_model_name=inp.artifact,
        gpu=engine["platform"]["platform"] == "cuda",
    )
    try:
        with srv:
            timings["engine_start_s"] = srv.start_s
            extra["engine"] = {**engine, "shared": False, "serve_command": serve_command(srv)}
            return _evaluate(srv, inp, src, out, tok, rows, settings, baseline_eval, scores, timings, extra)
    except ServerDied as e:
        fault = fault_cause(e.reason, e.log_tail, started=srv.start_s is not None)
        if fault:
            raise HostFault(
                f"{inp.artifact}: the evaluation's vLLM server failed: {fault} ({e.reason}). A fault of this host, "
                f"not of the model: nothing was kept, and the next run evaluates it again (its log: {out / 'server.log'})"
            ) from None
        raise StageError(
            f"{inp.artifact}: the evaluation's vLLM server could not load the model: {e.reason}; evaluate it with "
            f"evaluation.lm_eval.backend: hf (its log: {out / 'server.log'})"
        ) from None


def serve_command(srv) -> str:
    """The server's `vllm serve ...` command line (its port as it ran)."""
    return " ".join(["vllm", *srv.command()[3:]])


def own_engine(
    src: Path, trust_remote_code: bool, artifact: str, method: str, settings: dict, le
) -> tuple[list[str], dict]:
    """`vllm serve` flags of the evaluation's own server, and what was decided; refused before any server starts when
    vLLM has no kernel for the checkpoint's scheme on this machine."""
    # What vLLM can run here and the CPU KV-cache size, decided as for the benchmark stage (common.vllm_support).
    # Not in this stage's cache key: they decide a refusal, never cached, and a KV-cache size, which moves no figure.
    from ...common.safetensors import weights_bytes
    from ...common.shape import ModelShape
    from ...common.vllm_support import (
        DEFAULT_CPU_KV_BYTES,
        engine_flags,
        eval_kv_bytes,
        gpu_start_share,
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
    engine: dict = {"dtype": settings["dtype"], "seed": le.seed if le else 0, "enforce_eager": True}
    if trust_remote_code:
        engine["trust_remote_code"] = True
    shape = ModelShape.read(src)
    max_len = shape.max_len if shape else None
    if plat["platform"] == "cpu":  # room for one sequence of the model's full length
        bpt = ((shape.kv_bytes_per_token(None) if shape else None) or 0) * (2 if settings["dtype"] == "float32" else 1)
        need = bpt * (max_len or 0)
        engine["kv_cache_memory_bytes"] = max(DEFAULT_CPU_KV_BYTES, math.ceil(need / 2**20) * 2**20)
    elif le is not None and le.gpu_memory_utilization is not None:
        engine["gpu_memory_utilization"] = le.gpu_memory_utilization
    elif plat["platform"] == "cuda":  # sized as pre-flight and the scheduler count it (preflight.eval_server_terms)
        engine["kv_cache_memory_bytes"] = eval_kv_bytes(
            (shape.kv_bytes_per_token(None) if shape else None) or 0, max_len
        )
        share = gpu_start_share(engine, weights_bytes(src), plat)
        if share:
            engine["gpu_memory_utilization"] = share
    return engine_flags(engine), {"engine": engine, "platform": plat, "scheme": scheme}


def _evaluate(
    srv,
    inp,
    src: Path,
    out: Path,
    tok,
    rows,
    settings: dict,
    baseline_eval: Path | None,
    scores: Scores,
    timings: dict,
    extra: dict,
) -> tuple[dict | None, dict | None, dict | None]:
    lm_metrics = validation = fidelity = None
    if inp.lm_eval is not None:
        t0 = time.perf_counter()
        lm, model_args = api_model(srv, src, inp.lm_eval, settings, inp.base.trust_remote_code)
        extra["lm_eval_command"] = lm_eval_command(inp.lm_eval, model_args)
        lm_metrics = run_lm_eval(inp.lm_eval, model_args, out, settings, scores, lm=lm)
        timings["lm_eval_s"] = round(time.perf_counter() - t0, 2)
        log.info("%s: lm-eval %s in %.1fs", inp.artifact, json.dumps(lm_metrics), timings["lm_eval_s"])
    if rows is not None:
        t0 = time.perf_counter()
        bodies = [
            {
                "prompt": encode_prompt(tok, row, settings["add_bos"]),
                "max_tokens": inp.validation.max_new_tokens,
                "temperature": 0.0,
                "return_token_ids": True,
            }
            for row in rows
        ]
        outs = _complete_all(srv, bodies)
        texts = [output_text(tok, o["choices"][0]["token_ids"], inp.validation.stop) for o in outs]
        validation = score_validation(rows, texts, inp.validation, out, scores)
        timings["validation_s"] = round(time.perf_counter() - t0, 2)
        log.info("%s: validation %s", inp.artifact, json.dumps(validation))
    if rows is not None or inp.fidelity is not None:
        t0 = time.perf_counter()
        mine = prompt_logprobs(srv, sequences(inp, tok, rows, settings["add_bos"]))
        if baseline_eval is None:  # the baseline keeps its logprobs for the artifacts' stages
            (out / "fidelity_reference.json").write_text(json.dumps({"logprobs": VLLM_LOGPROBS, "sequences": mine}))
        else:
            try:
                ref = json.loads((Path(baseline_eval) / "fidelity_reference.json").read_text())["sequences"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise StageError(
                    f"baseline_eval {baseline_eval}: no readable fidelity_reference.json ({e!r}); re-run evaluate:baseline with backend vllm (--force evaluate)"
                ) from None
            fidelity = summarize(fidelity_topk(ref, mine), inp.bootstrap_samples, *source(inp))
            if fidelity is not None:
                fidelity["kl_support"] = (
                    f"top-{VLLM_LOGPROBS} logprobs per position + one bucket for the rest (a lower bound of the full KL)"
                )
            log.info("%s: fidelity vs baseline %s", inp.artifact, json.dumps(fidelity))
        timings["fidelity_s"] = round(time.perf_counter() - t0, 2)
    return lm_metrics, validation, fidelity


def api_model(srv, src: Path, le, settings: dict, trust_remote_code: bool):
    """lm-eval's local-completions model on `srv`, built as `lm_eval --model local-completions --model_args ...` builds it."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from ...common.shape import ModelShape

    model_args = {
        "model": srv.served_model_name,
        "base_url": f"{srv.url}/v1/completions",
        "tokenizer": str(src),
        "tokenizer_backend": "huggingface",
        "tokenized_requests": True,
        "add_bos_token": settings["add_bos"],
        "max_length": (shape.max_len if (shape := ModelShape.read(src)) else None) or 2048,
        "num_concurrent": CONCURRENT,
        "max_retries": 1,
        "timeout": REQUEST_TIMEOUT_S,
        "seed": le.seed,
    }
    if trust_remote_code:
        model_args["trust_remote_code"] = True
    lm = LocalCompletionsAPI.create_from_arg_obj(
        model_args, {"batch_size": le.batch_size, "device": settings["device"]}
    )
    return lm, model_args


def lm_eval_command(le, model_args: dict) -> str:
    """The `lm_eval` command line that gives the same lm-eval figures against the same server."""
    cmd = [
        "lm_eval",
        "--model",
        "local-completions",
        "--model_args",
        ",".join(f"{k}={v}" for k, v in model_args.items()),
        "--tasks",
        ",".join(le.tasks),
        "--batch_size",
        str(le.batch_size),
        "--seed",
        str(le.seed),
    ]
    if le.num_fewshot is not None:
        cmd += ["--num_fewshot", str(le.num_fewshot)]
    if le.limit is not None:
        cmd += ["--limit", str(le.limit)]
    if le.include_path:
        cmd += ["--include_path", le.include_path]
    if le.apply_chat_template:
        cmd += ["--apply_chat_template", "--fewshot_as_multiturn"]
    return " ".join(cmd)


def _complete_all(srv, bodies: list[dict]) -> list[dict]:
    """Each body posted to /v1/completions (CONCURRENT at a time), the responses in order."""

    def post(body: dict) -> dict:
        req = urllib.request.Request(
            f"{srv.url}/v1/completions",
            data=json.dumps({"model": srv.served_model_name, **body}).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:400]
            raise StageError(
                f"the vLLM server refused an evaluation request of {len(body['prompt'])} tokens (HTTP {e.code}: {detail}); "
                "a request longer than the served max_model_len needs a larger benchmark.engine.max_model_len"
            ) from None
        except (urllib.error.URLError, OSError) as e:
            srv.check_alive()
            raise StageError(f"an evaluation request to the vLLM server failed ({e})") from None

    with ThreadPoolExecutor(CONCURRENT) as ex:
        return list(ex.map(post, bodies))


def prompt_logprobs(srv, seqs: list[tuple[list[int], int]]) -> list[list[dict]]:
    """Per sequence (ids, first scored position), per scored token: its id and logprob, and the top logprobs of its position."""
    outs = _complete_all(
        srv, [{"prompt": ids, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": VLLM_LOGPROBS} for ids, _ in seqs]
    )
    result = []
    for (ids, start), o in zip(seqs, outs):
        plp = o["choices"][0]["prompt_logprobs"]
        positions = []
        for j in range(start, len(ids)):
            d = plp[j]  # the position that predicts token j: {token id: {logprob, rank, ...}}
            top = sorted(
                (
                    (int(t), float(v["logprob"]))
                    for t, v in d.items()
                    if v.get("rank") is not None and v["rank"] <= VLLM_LOGPROBS
                ),
                key=lambda x: -x[1],
            )
            positions.append({"target": int(ids[j]), "target_logprob": float(d[str(ids[j])]["logprob"]), "top": top})
        result.append(positions)
    return result


def kl_topk(p: dict[int, float], q: dict[int, float]) -> float:
    """KL(P || Q) of two next-token distributions known by the logprobs of some tokens each. Tokens known on both sides
    count one by one, all others go into one `rest` bucket; merging tokens never raises KL (log-sum inequality), so this
    is a lower bound of the full-vocabulary KL, exact when the shared tokens hold all the probability. Q's rest is floored
    at 1e-6 (float32 logprobs sum to 1 within about that), which keeps it a lower bound."""
    shared = p.keys() & q.keys()
    kl = math.fsum(math.exp(p[t]) * (p[t] - q[t]) for t in shared)
    p_rest = 1.0 - math.fsum(math.exp(p[t]) for t in shared)
    q_rest = 1.0 - math.fsum(math.exp(q[t]) for t in shared)
    if p_rest > 0 and p_rest != q_rest:
        kl += p_rest * (math.log(p_rest) - math.log(max(q_rest, 1e-6)))
    return max(kl, 0.0)


def fidelity_topk(base: list, mine: list) -> list[dict]:
    """Per sequence, from the vLLM prompt logprobs of both: the sums of KL(baseline || artifact) over each position's top
    logprobs (kl_topk), top-1 agreements and negative log-likelihoods of the scored tokens, with their count."""
    if len(base) != len(mine) or any([x["target"] for x in b] != [x["target"] for x in a] for b, a in zip(base, mine)):
        raise StageError(
            "the baseline's fidelity logprobs are for other tokens than this artifact's; re-run evaluate:baseline (--force evaluate)"
        )
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
