"""Calibration data: the texts llm-compressor calibrates on, read, checked, sampled, templated and hashed.

Sources are local `.jsonl` / `.json` / `.parquet` files whose rows hold a `text` field or chat `messages` (rendered with
the model's own chat template: calibrating a fine-tuned chat model on raw text is the usual mistake), or hub datasets.
Sources mix by weight; `seed` and `shuffle` make the draw repeatable. The sha256 of the token ids used goes into the
stage's metrics and `calibration.json`, so artifacts can be told apart by their data. Reading and sampling need no torch:

    from quantpipe.calibration import check
    check(recipe.calibration)   # -> [] or ["data/cal.jsonl:17: not valid JSON (...)", ...]
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .recipe import Calibration, CalibrationSource
from .stages import StageError

log = logging.getLogger(__name__)


@dataclass
class Row:
    """One calibration example before tokenizing: raw text, or chat messages to template."""

    where: str  # "file.jsonl:12", "file.parquet row 3", "org/ds[train] row 9"
    text: str | None = None
    messages: list[dict] | None = None


@dataclass
class Prepared:
    """The calibration set as llm-compressor receives it, with its provenance."""

    input_ids: list[list[int]]
    rows: list[Row]
    truncated: int
    sources: list[dict] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return sum(len(i) for i in self.input_ids)

    @property
    def sha256(self) -> str:
        return ids_sha256(self.input_ids)

    def dataset(self):
        """A tokenized `datasets.Dataset` (input_ids + attention_mask): oneshot skips its own tokenizing."""
        from datasets import Dataset

        return Dataset.from_dict(
            {"input_ids": self.input_ids, "attention_mask": [[1] * len(i) for i in self.input_ids]}
        )

    def provenance(self, calibration: Calibration) -> dict:
        return {
            "calibration_sha256": self.sha256,
            "n_samples": len(self.input_ids),
            "n_tokens": self.n_tokens,
            "truncated_samples": self.truncated,
            "num_samples_asked": calibration.num_samples,
            "max_seq_len": calibration.max_seq_len,
            "seed": calibration.seed,
            "shuffle": calibration.shuffle,
            "chat_template": calibration.chat_template,
            "n_chat_samples": sum(r.messages is not None for r in self.rows),
            "sources": self.sources,
            "samples": [r.where for r in self.rows],
        }


def ids_sha256(input_ids: list[list[int]]) -> str:
    """Content hash of tokenized samples: each is length-prefixed so [1,2][3] != [1][2,3]."""
    h = hashlib.sha256()
    for ids in input_ids:
        h.update(struct.pack("<I", len(ids)))
        h.update(struct.pack(f"<{len(ids)}I", *ids))
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --- reading ----------------------------------------------------------------------------------


def _label(i: int, s: CalibrationSource) -> str:
    return f"calibration.sources.{i} ({s.path or s.dataset})"


def _records(s: CalibrationSource, i: int) -> list[tuple[str, Any]]:
    """(where, record) for every row of a source, in file order."""
    if s.dataset is not None:
        return _hub_records(s, i)
    p = Path(s.path)
    if not p.is_file():
        raise StageError(f"{_label(i, s)}: {p} does not exist; fix the path in the recipe")
    suffix = p.suffix.lower()
    if suffix == ".jsonl":
        out = []
        with open(p, "rb") as f:
            for n, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise StageError(f"{p}:{n}: not UTF-8 text; re-encode the file as UTF-8") from None
                if not line.strip():
                    continue
                try:
                    out.append((f"{p}:{n}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise StageError(
                        f"{p}:{n}: not valid JSON ({e.msg} at column {e.colno}); fix or remove that line"
                    ) from None
        return out
    if suffix == ".json":
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise StageError(f"{p}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno}); fix the file") from None
        except UnicodeDecodeError:
            raise StageError(f"{p}: not UTF-8 text; re-encode the file as UTF-8") from None
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise StageError(
                f"{p}: a .json calibration file must hold a list of rows (objects); got {type(data).__name__}. Use .jsonl for one row per line"
            )
        return [(f"{p} row {n}", r) for n, r in enumerate(data)]
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise StageError(
                f"{p}: reading .parquet needs pyarrow in this environment; install it or convert the file to .jsonl"
            ) from None
        try:
            table = pq.read_table(p)
        except Exception as e:
            raise StageError(f"{p}: cannot read it as parquet ({type(e).__name__}: {e}); check the file") from None
        return [(f"{p} row {n}", r) for n, r in enumerate(table.to_pylist())]
    raise StageError(f"{_label(i, s)}: {p.name} must end in .jsonl, .json or .parquet")


def _hub_records(s: CalibrationSource, i: int) -> "_HubRows":
    import os

    try:
        from datasets import load_dataset
    except ImportError:
        raise StageError(
            f"{_label(i, s)}: hub datasets need the `datasets` package; install it or export the data to a local .jsonl"
        ) from None
    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        offline = " (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set)"
    else:
        offline = ""
    try:
        ds = load_dataset(s.dataset, split=s.split)
    except Exception as e:  # offline, unknown id, gated, bad split...
        raise StageError(
            f"{_label(i, s)}: cannot load hub dataset {s.dataset!r} split {s.split!r}{offline}: "
            f"{type(e).__name__}: {str(e)[:300]}. Without a network, export it on a machine that has one "
            "(e.g. `ds.to_json('cal.jsonl')`) and give `path:` instead of `dataset:`"
        ) from None
    col = s.column
    if col is not None and col not in ds.column_names:
        raise StageError(
            f"{_label(i, s)}: split {s.split!r} has no column {col!r}; it has {', '.join(ds.column_names)}. Fix `column`"
        )
    return _HubRows(ds, f"{s.dataset}[{s.split}]")


class _HubRows:
    """A hub split as a lazy sequence of (where, row): rows are materialised only when drawn."""

    def __init__(self, ds, label: str):
        self.ds, self.label = ds, label

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, j: int) -> tuple[str, Any]:
        return f"{self.label} row {j}", self.ds[int(j)]


def _row(where: str, rec: Any, column: str | None, mode: str, hub: bool) -> Row | None:
    """Turn a record into a Row, or raise a StageError naming where it is. Hub rows with empty text are skipped (None)."""
    if not isinstance(rec, dict):
        raise StageError(f"{where}: a row must be a JSON object with `text` or `messages`, got {type(rec).__name__}")
    if column is not None:
        if column not in rec:
            raise StageError(
                f"{where}: no field {column!r} (the source's `column`); the row has {', '.join(map(str, rec)) or 'no fields'}"
            )
        value = rec[column]
        kind = "messages" if isinstance(value, list) else "text"
    else:
        has_m, has_t = "messages" in rec, "text" in rec
        if mode == "always" and not has_m:
            raise StageError(
                f"{where}: chat_template is `always` but the row has no `messages`; add them or set calibration.chat_template: auto"
            )
        if mode == "never" and not has_t:
            raise StageError(
                f"{where}: chat_template is `never` but the row has no `text` field; add one or set calibration.chat_template: auto"
            )
        if not has_m and not has_t:
            raise StageError(
                f"{where}: no `text` or `messages` field (it has {', '.join(map(str, rec)) or 'none'}); add one or set the source's `column`"
            )
        kind = "messages" if has_m and mode != "never" else "text"
        value = rec[kind]
    if kind == "messages":
        if mode == "never":
            raise StageError(
                f"{where}: field {column!r} holds chat messages but chat_template is `never`; point `column` at a text field"
            )
        if not value or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
        ):
            raise StageError(
                f"{where}: `messages` must be a non-empty list of {{role, content}} objects with string values"
            )
        if not any(m["content"].strip() for m in value):
            if hub:
                return None
            raise StageError(f"{where}: every message is empty; remove the row or fill it in")
        return Row(where, messages=[{"role": m["role"], "content": m["content"]} for m in value])
    if not isinstance(value, str):
        raise StageError(f"{where}: field {column or 'text'!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        if hub:
            return None  # hub corpora (wikitext...) are full of blank rows: skip, counted in the log
        raise StageError(f"{where}: empty text; remove the row or fill it in")
    return Row(where, text=value)


def _allocate(total: int, weights: list[float]) -> list[int]:
    """Split `total` samples across sources by weight (largest remainder, ties to the earlier source)."""
    s = sum(weights)
    exact = [total * w / s for w in weights]
    n = [int(x) for x in exact]
    for j in sorted(range(len(weights)), key=lambda j: (-(exact[j] - n[j]), j))[: total - sum(n)]:
        n[j] += 1
    return n


def _draw(s: CalibrationSource, i: int, want: int, c: Calibration) -> tuple[list[Row], dict]:
    """`want` rows of one source: a local file is checked in full, a hub dataset read only as far as the draw needs."""
    hub = s.dataset is not None
    recs = _records(s, i)
    rng = random.Random(f"{c.seed}:{i}")
    if not hub:
        rows = [_row(w, rec, s.column, c.chat_template, False) for w, rec in recs]
        picked = rng.sample(range(len(rows)), min(want, len(rows))) if c.shuffle else range(min(want, len(rows)))
        taken, usable = [rows[j] for j in picked], len(rows)
    else:
        order = rng.sample(range(len(recs)), len(recs)) if c.shuffle else range(len(recs))
        taken, seen = [], 0
        for j in order:
            if len(taken) == want:
                break
            seen += 1
            r = _row(*recs[j], s.column, c.chat_template, True)
            if r is not None:
                taken.append(r)
        if seen > len(taken):
            log.warning("%s: skipped %d empty rows", _label(i, s), seen - len(taken))
        usable = len(taken) if len(taken) < want else None  # unknown unless the whole split was read
    if not taken:
        raise StageError(
            f"{_label(i, s)}: no usable rows (it is empty); add rows with `text` or `messages`, or remove the source"
        )
    if len(taken) < want:
        log.warning(
            "%s: asked for %d samples (weight %.3g of %d) but it has %d usable rows; using all %d",
            _label(i, s),
            want,
            s.weight,
            c.num_samples,
            len(taken),
            len(taken),
        )
    entry = (
        {"dataset": s.dataset, "split": s.split} if hub else {"path": s.path, "file_sha256": file_sha256(Path(s.path))}
    )
    return taken, {
        **entry,
        "column": s.column,
        "weight": s.weight,
        "rows": len(recs),
        "usable_rows": usable,
        "asked": want,
        "taken": len(taken),
    }


def select(calibration: Calibration) -> tuple[list[Row], list[dict]]:
    """Read the sources, check their rows, draw `num_samples` mixed by weight. No torch, no tokenizer."""
    c = calibration
    quota = _allocate(c.num_samples, [s.weight for s in c.sources])
    chosen: list[Row] = []
    info = []
    for i, (s, want) in enumerate(zip(c.sources, quota)):
        rows, entry = _draw(s, i, want, c)
        chosen += rows
        info.append(entry)
    if len(chosen) < c.num_samples:
        log.warning(
            "calibration: %d samples instead of the %d asked for (the sources hold too few rows)",
            len(chosen),
            c.num_samples,
        )
    if c.shuffle:
        random.Random(c.seed).shuffle(chosen)
    return chosen, info


def check(calibration: Calibration | None) -> list[str]:
    """Problems with a recipe's calibration data, found without torch (for `quantpipe check`)."""
    if calibration is None:
        return []
    local = calibration.model_copy(update={"sources": [s for s in calibration.sources if s.path]})
    if not local.sources:
        return []
    try:
        select(local)
    except StageError as e:
        return [str(e)]
    return []


# --- templating and tokenizing ----------------------------------------------------------------


def render(rows: list[Row], tokenizer) -> list[tuple[str, bool]]:
    """(text, is_chat) per row: chat rows through the tokenizer's own chat template."""
    out = []
    for r in rows:
        if r.messages is None:
            out.append((r.text, False))
            continue
        if not getattr(tokenizer, "chat_template", None):
            raise StageError(
                f"{r.where}: the row has chat `messages` but the model's tokenizer has no chat template; "
                "add one to the model (chat_template.jinja) or set calibration.chat_template: never and give `text`"
            )
        try:
            text = tokenizer.apply_chat_template(r.messages, tokenize=False)
        except Exception as e:  # template errors (e.g. roles the template refuses)
            raise StageError(
                f"{r.where}: the model's chat template failed on this row ({type(e).__name__}: {e}); fix the row's roles/order"
            ) from None
        out.append((text, True))
    return out


def prepare(calibration: Calibration, tokenizer) -> Prepared:
    """Select, template and tokenize the calibration set; truncate to max_seq_len with a warning."""
    rows, info = select(calibration)
    texts = render(rows, tokenizer)
    ids, truncated = [], 0
    for (text, chat), r in zip(texts, rows):
        # a rendered chat template already holds its special tokens (BOS...); plain text gets them from the tokenizer
        x = tokenizer(text, add_special_tokens=not chat)["input_ids"]
        if not x:
            raise StageError(f"{r.where}: tokenizes to nothing; remove the row")
        if len(x) > calibration.max_seq_len:
            truncated += 1
            x = x[: calibration.max_seq_len]
        ids.append([int(t) for t in x])
    if truncated:
        log.warning(
            "calibration: %d of %d samples were longer than max_seq_len=%d tokens and were truncated",
            truncated,
            len(ids),
            calibration.max_seq_len,
        )
    return Prepared(ids, rows, truncated, info)
