"""Rows as the stages will tokenize them, checked before any stage: validation prompts against the model's context
(file:line, the row's length, the context), and calibration and validation chat rows through the chat template, whose
sandbox may reject a row. The one input check that loads a tokenizer (transformers, never remote code): `quantpipe.inputs`
asks it last, once the files it reads have passed every other check.

    from quantpipe.tokenized import problems
    problems(recipe, Path(recipe.base.model), validation_rows, calibration_rows)
    # -> ["data/val.jsonl:7: the prompt is 2113 tokens, and with evaluation.validation.max_new_tokens 32 ..."]
"""

from __future__ import annotations

from pathlib import Path

from .common.hf_config import read_config, text_part
from .fit import model_context, tokenizer_dir

VOCAB_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
)  # a tokenizer transformers can build, not a config alone


def problems(recipe, model_dir: Path, validation_rows: list[dict] | None, calibration_rows: list | None) -> list[str]:
    """Every row the merged model's tokenizer refuses; [] when there is no tokenizer transformers can load without remote
    code (the stage that needs one then names the problem in its own words). The tokenizer (transformers and torch, some
    seconds) is loaded only where a row could be refused: chat rows, or a prompt whose bytes could exceed the context."""
    chat_rows = [r for r in calibration_rows or [] if r.messages is not None]
    c = read_config(model_dir)
    ctx = model_context(text_part(c)) if c else None
    val = [r for r in validation_rows or [] if ctx and ("messages" in r or _may_exceed(recipe, r, ctx[0]))]
    if not val and not chat_rows:
        return []
    tok_dir = tokenizer_dir(recipe, model_dir)
    if not any((tok_dir / f).is_file() for f in VOCAB_FILES):
        return []
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tok_dir))
    except Exception:  # noqa: BLE001 - any tokenizer transformers cannot load: the stage names it with its own error
        return []
    return calibration_problems(tok, chat_rows) + (validation_problems(recipe, tok, tok_dir, ctx, val) if val else [])


def _may_exceed(recipe, row: dict, context: int) -> bool:
    """Whether a raw prompt could leave too little room: each token covers at least one byte of text (byte-level BPE,
    SentencePiece with byte fallback, words), plus a few special tokens the tokenizer adds."""
    return len(row["prompt"].encode()) + 8 + recipe.evaluation.validation.max_new_tokens > context


def calibration_problems(tok, chat_rows: list) -> list[str]:
    """The first calibration chat row the chat template rejects (calibration.render, as the quantize stage runs it)."""
    from .calibration import render
    from .stages import StageError

    try:
        render(chat_rows, tok)
    except StageError as e:
        return [str(e)]
    return []


def validation_problems(recipe, tok, tok_dir: Path, ctx: tuple, rows: list[dict], most: int = 3) -> list[str]:
    """Validation rows whose prompt, tokenized as the evaluate stage does (chat rows through the chat template), and
    max_new_tokens do not fit the model's context; rows the chat template cannot render."""
    from .stages import StageError
    from .stages.evaluate.validation import encode_prompt

    v = recipe.evaluation.validation
    out, limit = [], ctx[0]
    add_bos = recipe.evaluation.add_bos is not False
    for row in rows:
        try:
            n = len(encode_prompt(tok, row, add_bos))
        except StageError as e:
            out.append(str(e))
            continue
        except Exception as e:  # noqa: BLE001 - the template's own error (jinja's sandbox, raise_exception)
            out.append(
                f"{row['_where']}: the chat template of {tok_dir} cannot render this row's messages "
                f"({type(e).__name__}: {str(e)[:200]}); fix the template or the row"
            )
            continue
        if n + v.max_new_tokens > limit:
            out.append(
                f"{row['_where']}: the prompt is {n} tokens, and with evaluation.validation.max_new_tokens "
                f"{v.max_new_tokens} the row needs {n + v.max_new_tokens} positions, more than the model's context "
                f"({ctx[0]}: {ctx[1]} in config.json); shorten the prompt or lower max_new_tokens"
            )
    return out[:most] + ([f"... and {len(out) - most} more validation rows like these"] if len(out) > most else [])
