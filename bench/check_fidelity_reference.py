"""The hf evaluation's fidelity from the baseline stage's kept hidden states against a forward pass of the baseline.

For each artifact of a run's stage cache: the per-window KL, top-1 agreements and log-likelihoods computed as the
evaluate stage computes them (the baseline's logits from its output layer, rebuilt alone from the checkpoint, applied to
the kept hidden states), and again with the baseline's whole forward pass, on this host's device; equal or not, the
largest difference, and the time each took. Also whether the baseline stage kept hidden states at all (it keeps none
when its output layer alone does not give its logits bit for bit, and its artifacts then run the forward pass) and
whether the output layer alone could be rebuilt (else the stage loads the whole baseline).

    python bench/check_fidelity_reference.py CACHE --documents heldout.jsonl [--json OUT]

The windows' length and the token budget are the ones the baseline's evaluation recorded.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def one(pattern: str, root: Path) -> Path:
    found = sorted(root.glob(pattern))
    if len(found) != 1:
        sys.exit(f"{root}/{pattern}: expected one directory, found {len(found)} (use a stage cache of one run)")
    return found[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cache", type=Path, help="the run's stage cache (QUANTPIPE_CACHE)")
    p.add_argument("--documents", required=True, help="the recipe's evaluation.fidelity.path")
    p.add_argument("--json", type=Path)
    a = p.parse_args()

    import torch
    from transformers import AutoTokenizer

    from quantpipe.stages.evaluate.fidelity import document_windows, load_documents
    from quantpipe.stages.evaluate.hf import REFERENCE, fidelity_full, load_head, load_model, load_reference

    stages = a.cache / "stages"
    base_eval = one("evaluate/baseline/*/out", stages)
    settings = json.loads((base_eval / "evaluation.json").read_text())["settings"]
    device, dtype = settings["device"], settings["dtype"]
    base_model = one("merge/*/out", stages)
    tok = AutoTokenizer.from_pretrained(str(base_model))
    f = settings["fidelity"]
    seqs = document_windows(tok, load_documents(a.documents), settings["add_bos"], f["seq_len"], f["max_tokens"])
    kept = load_reference(base_eval / REFERENCE, seqs)
    head = load_head(base_model, dtype, False, device, kept) if kept else None
    hidden = kept.states if kept else None
    result = {
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "dtype": dtype,
        "torch": torch.__version__,
        "windows": len(seqs),
        "kept_hidden_states": kept is not None,
        "output_layer_alone": head is not None,
        "artifacts": {},
    }
    print(json.dumps({k: v for k, v in result.items() if k != "artifacts"}), flush=True)
    ref = load_model(base_model, dtype, False, device)
    for d in sorted((stages / "evaluate").iterdir()):
        if d.name == "baseline":
            continue
        stage_fidelity = json.loads((one("*/out", d) / "evaluation.json").read_text())["fidelity"]
        model = load_model(one("*/out", stages / "quantize" / d.name), dtype, False, device)
        row: dict = {
            "stage_kl_mean": stage_fidelity["kl_mean"],
            "stage_baseline_logits": stage_fidelity.get("baseline_logits"),
        }
        runs = {}
        for how, h in ([("kept", hidden)] if hidden is not None else []) + [("forward", None)]:
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            runs[how] = fidelity_full(head if h is not None and head is not None else ref, model, seqs, h)
            if device == "cuda":
                torch.cuda.synchronize()
            row[f"{how}_s"] = round(time.perf_counter() - t0, 3)
        if "kept" in runs:
            k, f = runs["kept"], runs["forward"]
            row["equal"] = k == f
            row["max_abs_diff"] = {
                m: max(abs(x[m] - y[m]) for x, y in zip(k, f)) for m in ("kl", "agree", "nll", "nll_baseline")
            }
            row["kl_mean_kept"] = sum(x["kl"] for x in k) / sum(x["n"] for x in k)
        row["kl_mean_forward"] = sum(x["kl"] for x in runs["forward"]) / sum(x["n"] for x in runs["forward"])
        result["artifacts"][d.name] = row
        print(d.name, json.dumps(row), flush=True)
        del model
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
