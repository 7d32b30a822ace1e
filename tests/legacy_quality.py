"""Helper of tests/test_legacy.py, run in the gptqmodel environment (transformers 5 reads AWQ and GPTQ
checkpoints through gptqmodel): load each artifact with transformers, generate a few tokens, and
compare its next-token distributions with the baseline's on held-out text.

    .venv/gptqmodel/bin/python tests/legacy_quality.py BASELINE_DIR HELDOUT.jsonl '{"name": "dir", ...}'

Prints one JSON line: name -> {kl, ppl, top1, generated, layer0_down_proj}.
"""

import json
import math
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

DOCS, LENGTH = 32, 128
DTYPE = torch.float16  # AutoAWQ's GEMM format holds float16 scales; every model is compared in it


def logprobs(model, ids):
    with torch.no_grad():
        return [model(torch.tensor([x])).logits[0, :-1].float().log_softmax(-1) for x in ids]


def main(baseline: str, heldout: str, dirs: dict) -> dict:
    tok = AutoTokenizer.from_pretrained(baseline)
    texts = [json.loads(line)["text"] for line in Path(heldout).read_text().splitlines() if line.strip()]
    ids = [tok(t)["input_ids"][:LENGTH] for t in texts[:DOCS]]
    targets = [torch.tensor(x[1:]) for x in ids]
    base = logprobs(AutoModelForCausalLM.from_pretrained(baseline, dtype=DTYPE).eval(), ids)
    out = {}
    for name, d in dirs.items():
        model = AutoModelForCausalLM.from_pretrained(d, dtype=DTYPE).eval()
        q = logprobs(model, ids)
        kl = torch.cat([(b.exp() * (b - a)).sum(-1) for b, a in zip(base, q)]).mean().item()
        top1 = torch.cat([(b.argmax(-1) == a.argmax(-1)).float() for b, a in zip(base, q)]).mean().item()
        nll = torch.cat([-lp.gather(1, t[:, None])[:, 0] for lp, t in zip(q, targets)]).mean().item()
        prompt = AutoTokenizer.from_pretrained(d)("The", return_tensors="pt")
        gen = model.generate(**prompt, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
        text = tok.decode(gen[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
        layer = type(model.model.layers[0].mlp.down_proj).__name__
        out[name] = {"kl": kl, "ppl": math.exp(nll), "top1": top1, "generated": text, "layer0_down_proj": layer}
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))))
