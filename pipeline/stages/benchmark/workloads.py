"""The benchmark stage's workloads, checked and turned into what `vllm bench serve` reads, before any server starts:
`fixed` and `shared_prefix` are vLLM's random dataset (fixed lengths; a common prefix of `prefix_len` tokens), and
`validation` sends the validation set's prompts as the model sees them, each with an output length taken from its
reference, as a custom-dataset JSONL under out/workloads/."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from ...recipe import Engine, Validation, Workload
from .. import StageError


def workload_tokens(w: Workload, validation_max: int | None = None) -> int:
    """Longest sequence (prompt + output) a workload sends."""
    if w.kind == "validation":
        return (validation_max or 0) + w.output_len
    return (w.prefix_len if w.kind == "shared_prefix" else 0) + w.input_len + w.output_len


def validation_rows(workloads: list[Workload], validation: Validation | None) -> list[dict] | None:
    """The validation set's rows when a workload sends them (None when none does); checks the workloads' names."""
    names = [w.name for w in workloads]
    if len(set(names)) != len(names):
        raise StageError(f"benchmark.workloads: names must be unique; got {', '.join(names)}")
    if not any(w.kind == "validation" for w in workloads):
        return None
    if validation is None:
        bad = next(w.name for w in workloads if w.kind == "validation")
        raise StageError(
            f"workload {bad!r} has kind validation but evaluation.validation is not set; add it, or use kind fixed"
        )
    return read_validation(validation.path)


def read_validation(path: str) -> list[dict]:
    rows = []
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise StageError(f"evaluation.validation.path: cannot read {p} ({e.strerror}); fix the path") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise StageError(
                f"{p}:{i}: not valid JSON; each line must be a JSON object with `prompt` (or `messages`)"
            ) from None
        if not isinstance(row, dict) or not (
            isinstance(row.get("prompt"), str) or isinstance(row.get("messages"), list)
        ):
            raise StageError(f"{p}:{i}: expected a JSON object with `prompt` (text) or `messages` (chat turns)")
        rows.append(row)
    if not rows:
        raise StageError(f"{p}: no rows; add JSON lines with `prompt` and `reference`")
    return rows


def validation_dataset(w: Workload, rows: list[dict], tok, max_model_len: int | None, path: Path) -> dict:
    """Write the custom-dataset JSONL `vllm bench serve` reads: the prompts as the model sees them (`messages` through the
    chat template, as the evaluate stage does), each with the reference's token count as output length (1..output_len;
    output_len without a reference)."""
    items, dropped = [], 0
    for row in rows:
        if "messages" in row:
            if not getattr(tok, "chat_template", None):
                raise StageError(
                    "a validation row has chat `messages` but the tokenizer has no chat template; give `prompt` instead"
                )
            text = tok.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
        else:
            text = row["prompt"]
        n_in = len(tok(text)["input_ids"])
        ref = row.get("reference")
        n_out = w.output_len
        if isinstance(ref, str) and ref:
            n_out = max(1, min(w.output_len, len(tok(ref, add_special_tokens=False)["input_ids"])))
        if max_model_len and n_in + n_out > max_model_len:
            dropped += 1
            continue
        items.append({"prompt": text, "output_tokens": n_out, "_in": n_in})
    if not items:
        raise StageError(
            f"workload {w.name!r}: every validation prompt is longer than max_model_len {max_model_len}; raise benchmark.engine.max_model_len"
        )
    chosen = [items[i % len(items)] for i in range(w.num_prompts)]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for it in chosen:
            f.write(json.dumps({"prompt": it["prompt"], "output_tokens": it["output_tokens"]}) + "\n")
    return {
        "path": str(path),
        "rows": len(rows),
        "used": len(items),
        "dropped_too_long": dropped,
        "input_tokens_max": max(it["_in"] for it in items),
        "input_tokens_mean": round(statistics.mean(it["_in"] for it in items), 1),
        "output_tokens_mean": round(statistics.mean(it["output_tokens"] for it in items), 1),
    }


def dataset_args(w: Workload, data: dict | None) -> list[str]:
    if w.kind == "validation":
        return [
            "--dataset-name",
            "custom",
            "--dataset-path",
            data["path"],
            "--custom-output-len",
            "-1",
            "--skip-chat-template",
            "--disable-shuffle",
        ]
    prefix = w.prefix_len if w.kind == "shared_prefix" else 0
    return [
        "--dataset-name",
        "random",
        "--random-input-len",
        str(w.input_len),
        "--random-output-len",
        str(w.output_len),
        "--random-range-ratio",
        "0.0",
        "--random-prefix-len",
        str(prefix),
    ]


def workload_data(
    workloads: list[Workload], val_rows: list[dict] | None, variants: list[tuple[str, Engine]], tok, out: Path
) -> tuple[dict, int, list[dict]]:
    """(data of the validation workloads by name, longest sequence any workload sends, the workloads as measured);
    refuses a workload longer than a variant's max_model_len."""
    data: dict = {}
    described = []
    need = 0
    for w in workloads:
        if w.kind == "validation":
            mml = min([e.max_model_len for _, e in variants if e.max_model_len] or [0]) or None
            data[w.name] = validation_dataset(w, val_rows, tok, mml, out / "workloads" / f"{w.name}.jsonl")
            need = max(need, data[w.name]["input_tokens_max"] + w.output_len)
        else:
            need = max(need, workload_tokens(w))
        described.append({**w.model_dump(), **({"data": data[w.name]} if w.name in data else {})})
    for vname, e in variants:
        if e.max_model_len and any(w.kind != "validation" and workload_tokens(w) > e.max_model_len for w in workloads):
            w = next(w for w in workloads if w.kind != "validation" and workload_tokens(w) > e.max_model_len)
            raise StageError(
                f"workload {w.name!r} needs {workload_tokens(w)} tokens per sequence but variant {vname!r} has "
                f"max_model_len {e.max_model_len}; shorten the workload or raise max_model_len"
            )
    return data, need, described
