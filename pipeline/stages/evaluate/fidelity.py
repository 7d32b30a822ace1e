"""Fidelity to the baseline: the token sequences scored, and KL, top-1 agreement and perplexity with 95% intervals. With
`evaluation.fidelity`, held-out documents (one `{"text": ...}` per line) are tokenized with the tokenizer's BOS rule,
concatenated and cut into windows of `seq_len` tokens up to `max_tokens`, every position after a window's first scored;
without it, each validation row's reference tokens are scored after its prompt. The intervals are a bootstrap over
sequences, not tokens: tokens within one window are correlated (one passage, one topic), so resampling tokens would give
intervals that are too narrow.

    seqs = document_windows(tok, load_documents("data/heldout.jsonl"), add_bos=True, seq_len=256, max_tokens=20_000)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ...cache import sha256_file
from .. import StageError
from .compare import BOOTSTRAP_SEED
from .validation import continuation, encode_prompt

FIGURES = ("kl_mean", "top1_agreement", "ppl", "ppl_ratio")  # each gets `<figure>_ci95`


def load_documents(path: str | Path) -> list[str]:
    """The documents' texts; a bad line raises StageError naming file:line."""
    p = Path(path)
    if not p.is_file():
        raise StageError(
            f'evaluation.fidelity.path: {p} does not exist; point it at a JSONL file of held-out documents, one {{"text": ...}} per line'
        )
    docs = []
    with open(p, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise StageError(
                    f"{p}:{line_no}: not valid JSON ({e.msg} at column {e.colno}); each line must be one JSON object"
                ) from None
            if not (isinstance(row, dict) and isinstance(row.get("text"), str) and row["text"].strip()):
                raise StageError(
                    f"{p}:{line_no}: expected a JSON object with a non-empty string `text` (one held-out document per line)"
                )
            docs.append(row["text"])
    if not docs:
        raise StageError(f"{p}: no documents; add JSON lines with `text`")
    return docs


def document_windows(tok, docs: list[str], add_bos: bool, seq_len: int, max_tokens: int) -> list[tuple[list[int], int]]:
    """Windows of `seq_len` tokens of the concatenated documents, at most `max_tokens` tokens in all, as (ids, first scored
    position): each document is tokenized with the BOS rule, and a last window shorter than `seq_len` is dropped."""
    stream: list[int] = []
    for text in docs:
        starts_with_bos = tok.bos_token is not None and text.startswith(tok.bos_token)
        stream += tok(text, add_special_tokens=add_bos and not starts_with_bos)["input_ids"]
        if len(stream) >= max_tokens:
            break
    n = min(len(stream), max_tokens) // seq_len
    if n < 2:
        raise StageError(
            f"evaluation.fidelity: the documents give {len(stream)} tokens, fewer than two windows of seq_len {seq_len} (the intervals "
            "resample windows); add documents or lower seq_len"
        )
    return [(stream[i * seq_len : (i + 1) * seq_len], 1) for i in range(n)]


def validation_sequences(tok, rows: list[dict], add_bos: bool) -> list[tuple[list[int], int]]:
    """Each validation row with a reference as (prompt + reference ids, position of the first reference token)."""
    out = []
    for row in rows:
        if not row.get("reference"):
            continue
        p = encode_prompt(tok, row, add_bos)
        r = tok(continuation(row), add_special_tokens=False)["input_ids"]
        if r:
            out.append((p + r, len(p)))
    return out


def sequences(inp, tok, rows: list[dict] | None, add_bos: bool) -> list[tuple[list[int], int]]:
    """The sequences to score: the documents' windows, else the validation rows' references."""
    f = inp.fidelity
    if f is not None:
        return document_windows(tok, load_documents(f.path), add_bos, f.seq_len, f.max_tokens)
    return validation_sequences(tok, rows, add_bos) if rows else []


def source(inp) -> tuple[str, str]:
    """(source, unit): where the scored tokens come from, and what one resampled sequence is."""
    if inp.fidelity is not None:
        return "documents", f"windows of {inp.fidelity.seq_len} tokens"
    return "validation", "validation rows (their reference tokens)"


def settings(inp) -> dict:
    """What of fidelity must be equal between the baseline and an artifact (recorded in evaluation.json)."""
    f = inp.fidelity
    if f is None:
        return {"source": "validation", "scored": "the reference tokens of each validation row, after its prompt"}
    return {
        "source": "documents",
        "documents_sha256": sha256_file(Path(f.path))[:16],
        "seq_len": f.seq_len,
        "max_tokens": f.max_tokens,
        "scored": "every position after a window's first",
    }


def summarize(stats: list[dict], samples: int, source: str, unit: str, seed: int = BOOTSTRAP_SEED) -> dict | None:
    """Figures over all sequences (token-weighted) with a 95% percentile-bootstrap interval each, resampling sequences;
    `stats`: per sequence, the sums `kl`, `agree`, `nll` (artifact), `nll_baseline` and the token count `n`."""
    import numpy as np

    stats = [s for s in stats if s["n"]]
    if not stats:
        return None
    x = np.array([[s["kl"], s["agree"], s["nll"], s["nll_baseline"], s["n"]] for s in stats], dtype=np.float64)

    def figures(t):  # t[..., :] = summed columns of x
        n = t[..., 4]
        return {
            "kl_mean": t[..., 0] / n,
            "top1_agreement": t[..., 1] / n,
            "ppl": np.exp(t[..., 2] / n),
            "ppl_ratio": np.exp((t[..., 2] - t[..., 3]) / n),
        }

    total = x.sum(axis=0)
    out: dict = {k: float(v) for k, v in figures(total).items()}
    out["ppl_baseline"] = math.exp(total[3] / total[4])
    w = len(x)
    if w >= 2:
        rng = np.random.default_rng(seed)
        chunk = max(1, min(samples, 2_000_000 // w))  # bound memory at ~80 MB of resampled rows
        sums = [x[rng.integers(0, w, size=(min(chunk, samples - s), w))].sum(axis=1) for s in range(0, samples, chunk)]
        boot = figures(np.concatenate(sums))
        for k in FIGURES:
            lo, hi = np.percentile(boot[k], [2.5, 97.5])
            out[f"{k}_ci95"] = [float(lo), float(hi)]
        what = "windows" if source == "documents" else "rows"
        method = (
            f"bootstrap over {w} {unit} ({samples} resamples, seed {seed}); {what}, not tokens, are resampled because "
            f"the tokens within one are correlated"
        )
    else:
        out |= {f"{k}_ci95": None for k in FIGURES}
        method = f"none: one sequence ({unit}), nothing to resample"
    return out | {"n_tokens": int(total[4]), "n_windows": w, "source": source, "ci_method": method}
