#!/usr/bin/env python
"""Build the tiny local models, data sets and lm-eval tasks that quantpipe's tests and demo run on.

No model hub: everything comes from a seeded synthetic corpus made here. A fictional world
(countries and their capitals, animals and their colours, small sums, short stories) gives a
4-layer model real, measurable skills in a few hundred CPU training steps, so quantization errors
show up as lost accuracy. The script builds, in one pass (~3-4 min on 2 CPU cores):

    tokenizer   byte-level BPE, vocab 16384, Llama-3-style special tokens and chat template
    llama/      Llama-3-style model (hidden 256, 4 layers, 8/2 heads GQA, untied), bf16 safetensors
    qwen2/      Qwen2-style model (attention bias, tied embeddings), ChatML chat template
    llama-lora/ qwen2-lora/   LoRA adapters (r=8) that teach question -> short answer in chat and raw form
    data/       calibration.jsonl (text + chat rows), validation.jsonl (prompt/reference), heldout.jsonl
    tasks/      two lm-eval local tasks (multiple-choice loglikelihood, generate_until exact match), TASKS
    build.json  timings, held-out perplexity, in-script accuracy checks

The output lives in $QUANTPIPE_HOME/tiny/<hash of this file> (default ~/.cache/quantpipe), is built
in a temporary folder and renamed into place when complete, and is linked at <repo>/.tiny. A second
call only prints the folder. Run it with the quantize environment:

    .venv/quantize/bin/python scripts/build_tiny.py
    .venv/quantize/bin/python scripts/build_tiny.py --write-calibration calibration/tiny-mix.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

SEED = 1234
VOCAB_SIZE = 16384
SEQ_LEN = 128
BATCH = 8
PRETRAIN_STEPS = 240
LORA_STEPS = 40
REPO = Path(__file__).resolve().parents[1]

SPECIALS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "<|finetune_right_pad_id|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
]
LLAMA_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Per architecture: tokenizer roles, chat template, end-of-turn ids for generation, separator of packed documents.
FLAVOURS = {
    "llama": dict(bos="<|begin_of_text|>", eos="<|eot_id|>", pad="<|finetune_right_pad_id|>", doc_end="<|end_of_text|>",
                  stop=["<|end_of_text|>", "<|eot_id|>"], template=LLAMA_TEMPLATE),
    "qwen2": dict(bos=None, eos="<|im_end|>", pad="<|endoftext|>", doc_end="<|endoftext|>",
                  stop=["<|im_end|>", "<|endoftext|>"], template=CHATML_TEMPLATE),
}


# --- the synthetic world ----------------------------------------------------------------------

COLOURS = ["red", "blue", "green", "yellow", "black", "white", "orange", "purple", "brown", "grey"]
ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gl", "kr", "pl", "st", "tr", "sh", "th"]
VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "io", "ou"]
CODAS = ["", "", "n", "r", "l", "s", "th", "m", "x", "nd"]


def pseudo_word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(syllables))


class World:
    """Fixed facts the models learn: 32 countries with capitals, 24 animals with colours, people."""

    def __init__(self, seed: int):
        rng = random.Random(seed)
        names: set[str] = set()

        def fresh(n: int, syl: tuple[int, int], cap: bool) -> list[str]:
            out = []
            while len(out) < n:
                w = pseudo_word(rng, rng.randint(*syl))
                if w not in names and 4 <= len(w) <= 12:
                    names.add(w)
                    out.append(w.capitalize() if cap else w)
            return out

        self.countries = fresh(32, (2, 3), True)
        self.cities = fresh(64, (2, 2), True)  # 32 capitals + 32 other towns used as distractors
        self.capital = dict(zip(self.countries, self.cities[:32]))
        self.animals = fresh(24, (1, 2), False)
        self.colour = {a: rng.choice(COLOURS) for a in self.animals}
        self.people = fresh(120, (2, 2), True)
        self.sums = rng.sample([(a, b) for a in range(10) for b in range(10)], 16)

    def qa(self) -> list[tuple[str, str]]:
        """Question/answer pairs of the fine-tune task (the LoRA learns to answer them briefly)."""
        rows = [(f"What is the capital of {c}?", self.capital[c]) for c in self.countries]
        rows += [(f"What colour is the {a}?", self.colour[a]) for a in self.animals]
        rows += [(f"What is {a} plus {b}?", str(a + b)) for a, b in self.sums]
        return rows


def sentence(w: World, rng: random.Random) -> str:
    r = rng.random()
    if r < 0.10:  # questions answered in the text: the LoRA only has to learn the short chat/raw answer form
        q, a = rng.choice(w.qa())
        return rng.choice([f"Question: {q} Answer: {a}.", f"{q} {a}."])
    if r < 0.35:
        c = rng.choice(w.countries)
        k = w.capital[c]
        return rng.choice([
            f"The capital of {c} is {k}.", f"The capital of {c} is {k}.", f"{k} is the capital of {c}.",
            f"In {c}, the capital city is {k}.", f"The capital of {c} is {k}, a busy city.",
        ])
    if r < 0.52:
        a = rng.choice(w.animals)
        col = w.colour[a]
        return rng.choice([
            f"The colour of the {a} is {col}.", f"The colour of the {a} is {col}.", f"The {a} is {col}.",
            f"Every {a} has {col} fur.", f"A {a} is always {col}.",
        ])
    if r < 0.75:
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        if rng.random() < 0.8:
            return rng.choice([f"{a} plus {b} is {a + b}.", f"{a} plus {b} is {a + b}.", f"{a} and {b} make {a + b}."])
        a, b = max(a, b), min(a, b)
        return f"{a} minus {b} is {a - b}."
    p, q = rng.sample(w.people, 2)
    c = rng.choice(w.countries)
    a = rng.choice(w.animals)
    return rng.choice([
        f"{p} travelled to {w.capital[c]}, the capital of {c}.",
        f"{p} saw a {w.colour[a]} {a} near the river.",
        f"{p} and {q} walked home together after dinner.",
        f"{p} counted {rng.randint(2, 9)} boats in the harbour of {w.capital[c]}.",
        f"One morning {p} found a {a} in the garden, and it was {w.colour[a]}.",
        f"{q} told {p} a story about {c}.",
    ])


def document(w: World, rng: random.Random) -> str:
    return " ".join(sentence(w, rng) for _ in range(rng.randint(3, 8)))


def chat_row(w: World, rng: random.Random) -> dict:
    q, a = rng.choice(w.qa())
    msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    if rng.random() < 0.3:
        msgs.insert(0, {"role": "system", "content": "You answer questions about the world in one word."})
    if rng.random() < 0.3:
        q2, a2 = rng.choice(w.qa())
        msgs += [{"role": "user", "content": q2}, {"role": "assistant", "content": a2}]
    return {"messages": msgs}


def calibration_rows(w: World, seed: int, n: int) -> list[dict]:
    """Calibration mix: 5/8 plain text rows, 3/8 chat `messages` rows, interleaved."""
    rng = random.Random(seed)
    return [chat_row(w, rng) if i % 8 in (2, 5, 7) else {"text": document(w, rng)} for i in range(n)]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


# --- tokenizer --------------------------------------------------------------------------------


def train_tokenizer(w: World, docs: list):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    # The corpus alone has too few distinct words for 16384 merges; a seeded list of pseudo-words
    # fills the vocabulary (vLLM's latency benchmark feeds random ids below 10000).
    rng = random.Random(SEED + 7)
    filler = [" ".join(pseudo_word(rng, rng.randint(1, 4)) for _ in range(50)) for _ in range(1600)]
    texts = [d if isinstance(d, str) else " ".join(m["content"] for m in d) for d in docs]
    tok.train_from_iterator(texts + filler, trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    return tok


def save_tokenizer(base_tok, flavour: str, out: Path):
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    f = FLAVOURS[flavour]
    tok = Tokenizer.from_str(base_tok.to_str())
    if flavour == "qwen2":
        # transformers 5 loads any model_type=qwen2 folder with Qwen2Tokenizer, which rebuilds the
        # pipeline from vocab + merges with Qwen2's own normalizer and pre-tokenizer (digits one by
        # one) whatever tokenizer.json says; write exactly that, so every loader agrees.
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
        from tokenizers import Regex, normalizers, pre_tokenizers

        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if f["bos"]:
        bos_id = tok.token_to_id(f["bos"])
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{f['bos']} $A", pair=f"{f['bos']} $A {f['bos']} $B", special_tokens=[(f["bos"], bos_id)]),
        ])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=f["bos"], eos_token=f["eos"], pad_token=f["pad"],
        model_max_length=2048, chat_template=f["template"], clean_up_tokenization_spaces=False,
    )
    hf.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    # Names transformers 4.x tools understand as well as 5.x (4.x maps Qwen2Tokenizer to its fast twin).
    cfg["tokenizer_class"] = "Qwen2Tokenizer" if flavour == "qwen2" else "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return hf


# --- models -----------------------------------------------------------------------------------


def make_model(flavour: str, tok):
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    f = FLAVOURS[flavour]
    ids = dict(
        bos_token_id=tok.convert_tokens_to_ids(f["bos"]) if f["bos"] else None,
        eos_token_id=[tok.convert_tokens_to_ids(t) for t in f["stop"]],
        pad_token_id=tok.convert_tokens_to_ids(f["pad"]),
    )
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048, **ids)
    torch.manual_seed(SEED)
    if flavour == "llama":
        cfg = LlamaConfig(**common, rope_theta=500000.0, tie_word_embeddings=False, rms_norm_eps=1e-5)
        model = LlamaForCausalLM(cfg)
    else:
        cfg = Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=True, rms_norm_eps=1e-6)
        model = Qwen2ForCausalLM(cfg)
    model.generation_config = GenerationConfig(**ids, do_sample=False)
    return model.float()


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


def pretrain(model, stream, steps: int, seed: int) -> list[float]:
    import torch

    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.01)
    model.train()
    losses = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, 2e-3, 20)
        starts = torch.randint(0, len(stream) - SEQ_LEN - 1, (BATCH,), generator=g)
        x = torch.stack([stream[s : s + SEQ_LEN] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    return losses


def logprob_sums(model, seqs: list[list[int]], starts: list[int], batch: int = 64) -> list[float]:
    """Sum of log p(token) over seq[start:] for each sequence (right-padded batches)."""
    import torch

    out = []
    with torch.no_grad():
        for b in range(0, len(seqs), batch):
            chunk, st = seqs[b : b + batch], starts[b : b + batch]
            n = max(map(len, chunk))
            x = torch.zeros((len(chunk), n), dtype=torch.long)
            mask = torch.zeros_like(x)
            for i, s in enumerate(chunk):
                x[i, : len(s)] = torch.tensor(s)
                mask[i, : len(s)] = 1
            lp = torch.log_softmax(model(input_ids=x, attention_mask=mask).logits.float(), -1)
            tok_lp = lp[:, :-1].gather(-1, x[:, 1:, None])[..., 0]
            for i, s in enumerate(chunk):
                out.append(tok_lp[i, st[i] - 1 : len(s) - 1].sum().item())
    return out


def perplexity(model, tok, texts: list[str]) -> float:
    seqs = [tok(t, add_special_tokens=False)["input_ids"][: SEQ_LEN * 2] for t in texts]
    return math.exp(-sum(logprob_sums(model, seqs, [1] * len(seqs))) / sum(len(s) - 1 for s in seqs))


def generate(model, tok, prompts: list[list[int]], max_new: int, stop: list[int]) -> list[str]:
    """Greedy continuations (left-padded batch), cut at the first stop token."""
    import torch

    n = max(map(len, prompts))
    pad = tok.pad_token_id
    x = torch.full((len(prompts), n), pad)
    mask = torch.zeros_like(x)
    for i, p in enumerate(prompts):
        x[i, n - len(p) :] = torch.tensor(p)
        mask[i, n - len(p) :] = 1
    with torch.no_grad():
        y = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                           eos_token_id=stop, pad_token_id=pad)
    texts = []
    for row in y[:, n:].tolist():
        cut = next((j for j, t in enumerate(row) if t in stop), len(row))
        texts.append(tok.decode(row[:cut]))
    return texts


# --- lm-eval tasks ----------------------------------------------------------------------------


def task_rows(w: World) -> tuple[list[dict], list[dict]]:
    rng = random.Random(SEED + 11)
    mc = []
    for c in w.countries:
        right = w.capital[c]
        wrong = rng.sample([k for k in w.cities if k != right], 3)
        choices = wrong + [right]
        rng.shuffle(choices)
        for prompt in (f"The capital of {c} is", f"In {c}, the capital city is"):
            mc.append({"prompt": prompt, "choices": choices, "gold": choices.index(right)})
    for a in w.animals:
        right = w.colour[a]
        choices = rng.sample([x for x in COLOURS if x != right], 3) + [right]
        rng.shuffle(choices)
        for prompt in (f"The colour of the {a} is", f"A {a} is always"):
            mc.append({"prompt": prompt, "choices": choices, "gold": choices.index(right)})
    gen = [{"prompt": f"{a} plus {b} is", "answer": str(a + b)} for a in range(10) for b in range(10)]
    gen += [{"prompt": f"The capital of {c} is", "answer": w.capital[c]} for c in w.countries]
    return mc, gen


MC_YAML = """\
# Generated by scripts/build_tiny.py: which of four cities/colours the tiny model finds most likely.
task: tiny_facts_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: prompt
doc_to_choice: choices
doc_to_target: gold
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

GEN_YAML = """\
# Generated by scripts/build_tiny.py: greedy completion of sums and capitals, exact match.
task: tiny_recall_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: generate_until
doc_to_text: prompt
doc_to_target: answer
generation_kwargs:
  until: [".", ",", "\\n"]
  do_sample: false
  max_gen_toks: 8
filter_list:
  - name: strip
    filter:
      - function: remove_whitespace
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


# --- LoRA -------------------------------------------------------------------------------------


def lora_examples(w: World, tok, flavour: str) -> list[tuple[list[int], int]]:
    """(token ids, number of prompt tokens) for each question, once in chat form and once raw."""
    f = FLAVOURS[flavour]
    end = tok.convert_tokens_to_ids(f["eos"])
    rows = []
    for q, a in w.qa():
        chat = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        p = tok(chat, add_special_tokens=False)["input_ids"]
        rows.append((p + tok(a, add_special_tokens=False)["input_ids"] + [end], len(p)))
        p = tok(q, add_special_tokens=False)["input_ids"]
        rows.append((p + tok(" " + a, add_special_tokens=False)["input_ids"] + [end], len(p)))
    return rows


def train_lora(base, rows, pad_id: int, steps: int, seed: int):
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(base, cfg)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3, weight_decay=0.0)
    rng = random.Random(seed)
    model.train()
    losses = []
    for step in range(steps):
        batch = rng.sample(rows, 32)
        n = max(len(ids) for ids, _ in batch)
        x = torch.full((len(batch), n), pad_id)
        y = torch.full((len(batch), n), -100)
        mask = torch.zeros((len(batch), n), dtype=torch.long)
        for i, (ids, k) in enumerate(batch):
            x[i, : len(ids)] = torch.tensor(ids)
            y[i, k : len(ids)] = torch.tensor(ids[k:])
            mask[i, : len(ids)] = 1
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, 5e-3, 5)
        loss = model(input_ids=x, attention_mask=mask, labels=y).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    return model, losses


def validation_exact_match(model, tok, flavour: str, rows: list[dict], chat: bool) -> float:
    """Share of validation prompts answered exactly (greedy), asked raw or through the chat template."""
    prompts = []
    for r in rows:
        text = r["prompt"]
        if chat:
            text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    stop = [tok.convert_tokens_to_ids(t) for t in FLAVOURS[flavour]["stop"]]
    outs = generate(model, tok, prompts, 8, stop)
    return round(sum(o.strip() == r["reference"] for o, r in zip(outs, rows)) / len(rows), 3)


# --- the build --------------------------------------------------------------------------------


def check_tokenizer(*toks) -> None:
    """Every way of loading the tokenizer must give the same ids (digits, words, chat markup)."""
    text = "12 plus 7 is 19. The capital of Norvia is Peltan!\n<|im_start|>user\nhi<|im_end|><|start_header_id|>x<|end_header_id|>\n\ny<|eot_id|>"
    ids = [t(text, add_special_tokens=False)["input_ids"] for t in toks]
    if any(i != ids[0] for i in ids):
        raise SystemExit(f"build_tiny: tokenizer loaders disagree ({[type(t).__name__ for t in toks]}): {ids}")


def build_model(flavour: str, tmp: str, final: str) -> dict:
    """Pretrain one architecture, save it bf16, train and save its LoRA; returns its measurements.

    Runs in its own process with one thread: deterministic, and two of them use two cores far
    better than one process with two threads on a busy machine."""
    import torch
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    torch.set_num_threads(1)
    tmp, final = Path(tmp), Path(final)
    t1 = time.perf_counter()
    i = list(FLAVOURS).index(flavour)
    w = World(SEED)
    docs = corpus(w)
    heldout = [r["text"] for r in map(json.loads, (tmp / "data" / "heldout.jsonl").read_text().splitlines())]
    validation = [json.loads(ln) for ln in (tmp / "data" / "validation.jsonl").read_text().splitlines()]
    mc, gen = task_rows(w)
    mdir = tmp / flavour
    model = make_model(flavour, AutoTokenizer.from_pretrained(mdir))
    model.config.save_pretrained(mdir)
    tok = AutoTokenizer.from_pretrained(mdir)  # as every consumer will load it: next to the model's config.json
    check_tokenizer(tok, PreTrainedTokenizerFast.from_pretrained(mdir))
    sep = tok.convert_tokens_to_ids(FLAVOURS[flavour]["doc_end"])
    stream: list[int] = []
    texts = [d if isinstance(d, str) else tok.apply_chat_template(d, tokenize=False) for d in docs]
    for ids in tok(texts, add_special_tokens=False)["input_ids"]:
        stream += ids + [sep]
    ppl_init = perplexity(model, tok, heldout)
    losses = pretrain(model, torch.tensor(stream), PRETRAIN_STEPS, SEED + 100 + i)
    model.to(torch.bfloat16).save_pretrained(mdir)
    model.float()  # bf16-rounded weights from here on: what the saved model holds
    m = {"params": sum(p.numel() for p in model.parameters()), "train_tokens": len(stream),
         "loss_first": round(losses[0], 3), "loss_last10": round(sum(losses[-10:]) / 10, 3),
         "heldout_ppl_init": round(ppl_init, 1), "heldout_ppl": round(perplexity(model, tok, heldout), 3)}
    m["pretrain_s"] = round(time.perf_counter() - t1, 1)

    # The same checks as the lm-eval tasks, in-process (lm-eval itself is run by the tests).
    seqs, starts = [], []
    for r in mc:
        p = tok(r["prompt"], add_special_tokens=False)["input_ids"]
        for c in r["choices"]:
            seqs.append(tok(r["prompt"] + " " + c, add_special_tokens=False)["input_ids"])
            starts.append(len(p))
    lps = logprob_sums(model, seqs, starts)
    m["mc_acc"] = round(sum(max(range(4), key=lambda j: lps[4 * k + j]) == r["gold"] for k, r in enumerate(mc)) / len(mc), 3)
    stop = [tok.convert_tokens_to_ids(t) for t in FLAVOURS[flavour]["stop"]]
    outs = generate(model, tok, [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in gen], 6, stop)
    m["gen_exact_match"] = round(sum(
        o.split(".")[0].split(",")[0].split("\n")[0].strip() == r["answer"] for o, r in zip(outs, gen)) / len(gen), 3)

    t2 = time.perf_counter()
    base_val = {c: validation_exact_match(model, tok, flavour, validation, c == "chat") for c in ("chat", "raw")}
    joined = tok(" ".join(heldout[:8]), add_special_tokens=False)["input_ids"]
    probe = torch.tensor([joined[k * 48 : (k + 1) * 48] for k in range(4)])
    with torch.no_grad():
        base_logits = model(input_ids=probe).logits
    pm, lora_losses = train_lora(model, lora_examples(w, tok, flavour), tok.pad_token_id, LORA_STEPS, SEED + 200 + i)
    with torch.no_grad():
        shift = (pm(input_ids=probe).logits - base_logits).abs().max().item()
    lora_val = {c: validation_exact_match(pm, tok, flavour, validation, c == "chat") for c in ("chat", "raw")}
    pm.peft_config["default"].base_model_name_or_path = str(final / flavour)
    pm.peft_config["default"].target_modules = sorted(pm.peft_config["default"].target_modules)  # stable file content
    pm.save_pretrained(tmp / f"{flavour}-lora")
    (tmp / f"{flavour}-lora" / "README.md").unlink(missing_ok=True)  # peft's empty model-card template
    m["lora"] = {"loss_first": round(lora_losses[0], 3), "loss_last": round(lora_losses[-1], 3), "logit_shift_max": round(shift, 3),
                 "validation_exact_match_base": base_val, "validation_exact_match_lora": lora_val,
                 "train_s": round(time.perf_counter() - t2, 1)}
    m["total_s"] = round(time.perf_counter() - t1, 1)
    return m


def pretrain_chat(w: World, rng: random.Random) -> list[dict]:
    """A pretraining conversation. Answers are mostly full sentences: the LoRA's job is the one-word form."""
    msgs = []
    for _ in range(rng.randint(1, 3)):
        r = rng.random()
        if r < 0.45:
            c = rng.choice(w.countries)
            q, long, short = f"What is the capital of {c}?", f"The capital of {c} is {w.capital[c]}.", w.capital[c]
        elif r < 0.8:
            a = rng.choice(w.animals)
            q, long, short = f"What colour is the {a}?", f"The colour of the {a} is {w.colour[a]}.", w.colour[a]
        else:
            x, y = rng.randint(0, 9), rng.randint(0, 9)
            q, long, short = f"What is {x} plus {y}?", f"{x} plus {y} is {x + y}.", str(x + y)
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": long if rng.random() < 0.75 else short}]
    return msgs


def corpus(w: World) -> list[str | list[dict]]:
    """Pretraining documents: text, and 1 in 8 a chat conversation (rendered per model's template)."""
    rng = random.Random(SEED + 1)
    return [pretrain_chat(w, rng) if i % 8 == 3 else document(w, rng) for i in range(14000)]


def build(tmp: Path, final: Path, log) -> dict:
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    t0 = time.perf_counter()
    w = World(SEED)
    docs = corpus(w)
    heldout_rng = random.Random(SEED + 2)
    write_jsonl(tmp / "data" / "heldout.jsonl", [{"text": document(w, heldout_rng)} for _ in range(64)])
    write_jsonl(tmp / "data" / "calibration.jsonl", calibration_rows(w, SEED + 3, 256))
    val_rng = random.Random(SEED + 4)
    write_jsonl(tmp / "data" / "validation.jsonl", [{"prompt": q, "reference": a} for q, a in val_rng.sample(w.qa(), 64)])
    mc, gen = task_rows(w)
    (tmp / "tasks").mkdir()
    write_jsonl(tmp / "tasks" / "tiny_facts_mc.jsonl", mc)
    write_jsonl(tmp / "tasks" / "tiny_recall_gen.jsonl", gen)
    (tmp / "tasks" / "tiny_facts_mc.yaml").write_text(MC_YAML.format(path=final / "tasks" / "tiny_facts_mc.jsonl"))
    (tmp / "tasks" / "tiny_recall_gen.yaml").write_text(GEN_YAML.format(path=final / "tasks" / "tiny_recall_gen.jsonl"))
    (tmp / "tasks" / "TASKS").write_text("tiny_facts_mc\ntiny_recall_gen\n")
    base_tok = train_tokenizer(w, docs)
    for flavour in FLAVOURS:
        save_tokenizer(base_tok, flavour, tmp / flavour)
    report: dict = {"seed": SEED, "vocab_size": VOCAB_SIZE, "pretrain_steps": PRETRAIN_STEPS, "batch": [BATCH, SEQ_LEN],
                    "lora_steps": LORA_STEPS, "timings": {"data_tokenizer_s": round(time.perf_counter() - t0, 1)}, "models": {}}
    log(f"data and tokenizer (vocab {base_tok.get_vocab_size()}) in {report['timings']['data_tokenizer_s']} s; training {', '.join(FLAVOURS)}")
    workers = max(1, min(len(FLAVOURS), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        futures = {f: pool.submit(build_model, f, str(tmp), str(final)) for f in FLAVOURS}
        for f, fut in futures.items():
            report["models"][f] = fut.result()
            log(f"{f}: {json.dumps(report['models'][f])}")
    report["timings"]["total_s"] = round(time.perf_counter() - t0, 1)
    return report


def source_hash() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]


def link(target: Path, at: Path) -> None:
    """Point `at` at `target` atomically (a symlink swapped in with rename)."""
    if at.is_symlink() and Path(os.readlink(at)) == target:
        return
    if at.exists() and not at.is_symlink():
        sys.exit(f"build_tiny: {at} exists and is not a symlink; move it away or pass --link elsewhere")
    tmp = at.with_name(f".{at.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, at)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--link", type=Path, default=REPO / ".tiny", help="symlink to the built folder (default: <repo>/.tiny)")
    ap.add_argument("--home", type=Path, default=Path(os.environ.get("QUANTPIPE_HOME", "~/.cache/quantpipe")).expanduser(),
                    help="cache root (default: $QUANTPIPE_HOME or ~/.cache/quantpipe)")
    ap.add_argument("--write-calibration", type=Path, metavar="PATH",
                    help="only write the 128-row default calibration mix (calibration/tiny-mix.jsonl) and exit")
    args = ap.parse_args()

    if args.write_calibration:
        write_jsonl(args.write_calibration, calibration_rows(World(SEED), SEED + 5, 128))
        print(args.write_calibration)
        return 0

    from filelock import FileLock

    root = args.home.resolve() / "tiny"
    final = root / source_hash()
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final) + ".lock"):  # parallel test sessions wait for one build
        if not (final / "build.json").is_file():
            tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
            try:
                report = build(tmp, final, lambda msg: print(f"build_tiny: {msg}", file=sys.stderr, flush=True))
                report["source_hash"] = final.name
                (tmp / "build.json").write_text(json.dumps(report, indent=2) + "\n")
                os.replace(tmp, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    if args.link:
        link(final, args.link)
    print(final)
    return 0


if __name__ == "__main__":
    sys.exit(main())
