"""The validation set: reading and checking its rows, encoding its prompts, scoring the outputs. Light (no torch):
`quantpipe check` reads the rows with `load_validation` before anything runs, and both backends score with
`score_output`, so a row means the same under hf and vllm.

    from quantpipe.stages.evaluate import load_validation
    rows = load_validation("data/val.jsonl", "exact_match")
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

from .. import StageError

METRICS = ("exact_match", "contains", "regex", "json_valid")
# A `regex` reference is matched with this limit per output: a pattern that backtracks without end on one output scores
# that row as failed (named in the record and the report) instead of hanging the stage. Ordinary patterns take microseconds.
REGEX_TIMEOUT_S = 1.0


class PatternTimeout(Exception):
    """A validation row's `regex` reference ran past REGEX_TIMEOUT_S on one output."""


def load_validation(path: str | Path, default_metric: str, schema_path: str | None = None) -> list[dict]:
    """Read and check a validation JSONL; a bad row raises StageError naming file:line."""
    p = Path(path)
    if not p.is_file():
        raise StageError(f"evaluation.validation.path: {p} does not exist; point it at a JSONL file")
    rows = []
    with open(p, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{p}:{line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise StageError(
                    f"{where}: not valid JSON ({e.msg} at column {e.colno}); each line must be one JSON object"
                ) from None
            if not isinstance(row, dict):
                raise StageError(
                    f"{where}: expected a JSON object with `prompt` (or `messages`) and `reference`, got {type(row).__name__}"
                )
            has_prompt, has_msgs = "prompt" in row, "messages" in row
            if has_prompt == has_msgs:
                raise StageError(f"{where}: give exactly one of `prompt` (text) or `messages` (chat turns)")
            if has_prompt and not (isinstance(row["prompt"], str) and row["prompt"]):
                raise StageError(f"{where}: `prompt` must be a non-empty string")
            if has_msgs:
                msgs = row["messages"]
                if not (
                    isinstance(msgs, list)
                    and msgs
                    and all(
                        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                        for m in msgs
                    )
                ):
                    raise StageError(
                        f'{where}: `messages` must be a non-empty list of {{"role": ..., "content": ...}} objects with string values'
                    )
            metric = row.get("metric", default_metric)
            if metric not in METRICS:
                raise StageError(f"{where}: unknown metric {metric!r}; use one of {', '.join(METRICS)}")
            ref = row.get("reference")
            if metric != "json_valid" or ref is not None:
                if not isinstance(ref, str) or not ref.strip():
                    raise StageError(f"{where}: `reference` must be a non-empty string (metric {metric})")
            if metric == "regex":
                try:
                    re.compile(ref)
                except re.error as e:
                    raise StageError(
                        f"{where}: `reference` is not a valid regular expression ({e}); escape it or use metric contains"
                    ) from None
                nested = nested_quantifier(ref)
                if nested:
                    raise StageError(
                        f"{where}: `reference` repeats a group that itself repeats without a separator ({nested}), like "
                        "(a+)+: matching it can take exponential time on an ordinary output; drop the outer repeat "
                        "(a+ matches what (a+)+ does) or put a required character inside the group"
                    )
            rows.append({**row, "metric": metric, "_where": where, "_line": line_no})
    if not rows:
        raise StageError(f"{p}: no rows; add JSON lines with `prompt` and `reference`")
    if schema_path:
        schema = _load_schema(schema_path)
        for r in rows:
            r["_schema"] = schema
    return rows


def score_output(output: str, row: dict) -> float:
    """1.0 when the model's output satisfies the row's metric, else 0.0."""
    metric, ref = row["metric"], row.get("reference")
    if metric == "exact_match":
        return float(output.strip() == ref.strip())
    if metric == "contains":
        return float(ref.strip() in output)
    if metric == "regex":
        import regex  # re-compatible, and its matcher can be stopped after a time limit (a dependency of transformers)

        try:
            return float(regex.search(ref, output, timeout=REGEX_TIMEOUT_S) is not None)
        except TimeoutError:
            raise PatternTimeout(row.get("_where", "a validation row")) from None
    if metric == "json_valid":
        text = output.strip()
        m = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", text, re.S)  # models like to fence JSON
        try:
            value = json.loads(m.group(1) if m else text)
        except ValueError:
            return 0.0
        schema = row.get("_schema")
        return float(schema is None or not schema_errors(value, schema))
    raise StageError(f"unknown metric {metric!r}; use one of {', '.join(METRICS)}")


def nested_quantifier(pattern: str) -> str | None:
    """The first unbounded repeat whose body is itself an unbounded repeat plus only optional parts (`(a+)+`, `(\\w+\\s?)*`),
    as the text of that repeat; None when there is none. Such a body can split one run of text in exponentially many
    ways, and a backtracking matcher tries them all when the rest of the pattern fails. `(\\d+,)+` passes: the comma
    fixes where each repetition ends."""
    from re import _constants as c
    from re import _parser as sre

    try:
        parsed = sre.parse(pattern)
    except re.error:
        return None
    repeats = (c.MAX_REPEAT, c.MIN_REPEAT)

    def width(item) -> int:
        return sre.SubPattern(parsed.state, [item]).getwidth()[0]

    def loose(items) -> bool:
        """The items hold an unbounded repeat (directly or in a group or alternative) and nothing else of any width."""
        for i, (op, av) in enumerate(items):
            rest_optional = all(width(x) == 0 for j, x in enumerate(items) if j != i)
            if not rest_optional:
                continue
            if op in repeats and av[1] == c.MAXREPEAT:
                return True
            if op is c.SUBPATTERN and loose(av[3]):
                return True
            if op is c.BRANCH and any(loose(alt) for alt in av[1]):
                return True
        return False

    def find(items) -> bool:
        for op, av in items:
            if op in repeats and av[1] == c.MAXREPEAT and loose(av[2]):
                return True
            subs = {
                c.SUBPATTERN: lambda: [av[3]],
                c.BRANCH: lambda: av[1],
                c.ASSERT: lambda: [av[1]],
                c.ASSERT_NOT: lambda: [av[1]],
            }
            nested = [av[2]] if op in repeats else subs[op]() if op in subs else []
            if any(find(n) for n in nested):
                return True
        return False

    if not find(parsed.data):
        return None
    m = re.search(r"\((?:[^()\\]|\\.)*[+*}]\??(?:[^()\\]|\\.)*\)(?:[+*]|\{\d*,?\d*\})", pattern)
    return m.group(0) if m else pattern


def schema_errors(value, schema: dict) -> list[str]:
    """jsonschema's messages for each way `value` breaks `schema` (Draft 2020-12); [] when it matches."""
    jsonschema = _jsonschema()
    return [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(value)]


def _jsonschema():
    try:
        import jsonschema
    except ImportError:
        raise StageError(
            f"evaluation.validation.json_schema needs the jsonschema package, which this environment ({sys.executable}) lacks; "
            "scripts/setup_envs.sh rebuilds the environments from their locks, which include it"
        ) from None
    return jsonschema


def _load_schema(path: str) -> dict:
    """The schema file, refused unless it is a valid Draft 2020-12 JSON Schema whose every `$ref` resolves."""
    p = Path(path)
    try:
        schema = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise StageError(
            f"evaluation.validation.json_schema: cannot read {p} as JSON ({e}); give a JSON Schema file"
        ) from None
    if not isinstance(schema, dict):
        raise StageError(f"evaluation.validation.json_schema: {p} must hold a JSON object (a JSON Schema)")
    jsonschema = _jsonschema()
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "".join(f"[{k!r}]" for k in e.path) or "the top level"
        raise StageError(
            f"evaluation.validation.json_schema: {p} is not a valid JSON Schema (Draft 2020-12): {e.message} at {where}; fix it there"
        ) from None
    from referencing import Registry
    from referencing.exceptions import Unresolvable
    from referencing.jsonschema import DRAFT202012

    root = DRAFT202012.create_resource(schema)
    base = root.id() or ""
    try:
        _resolve_refs(Registry().with_resource(base, root).resolver(base), root)
    except Unresolvable as e:
        raise StageError(
            f"evaluation.validation.json_schema: {p} has a $ref that does not resolve ({e}); point it at a definition in the "
            'same file (e.g. "#/$defs/name"): the schema is read offline, so other files and URLs are not fetched'
        ) from None
    return schema


def _resolve_refs(resolver, resource) -> None:
    """Look up every `$ref` of the schema (relative to the `$id` above it), so a broken one is refused before any model runs."""
    contents = resource.contents
    if isinstance(contents, dict) and isinstance(contents.get("$ref"), str):
        resolver.lookup(contents["$ref"])
    for sub in resource.subresources():
        _resolve_refs(resolver.in_subresource(sub), sub)


def encode_prompt(tok, row: dict, add_bos: bool) -> list[int]:
    """Prompt ids: raw text with the tokenizer's own BOS rule; chat `messages` through the chat template, never a double BOS."""
    if "messages" in row:
        if not getattr(tok, "chat_template", None):
            raise StageError(
                f"{row['_where']}: the row has chat `messages` but the tokenizer has no chat template; give a `prompt` instead"
            )
        text = tok.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
    else:
        text = row["prompt"]
    starts_with_bos = tok.bos_token is not None and text.startswith(tok.bos_token)
    return tok(text, add_special_tokens=add_bos and not starts_with_bos)["input_ids"]


def continuation(row: dict) -> str:
    """The reference as the text that follows the prompt: a raw prompt and a reference that meet without whitespace get
    one space between them (lm-eval's default target_delimiter), so "2 plus 2 is" + "4" is scored as " 4", as the model
    would write it. Chat prompts end in the template's own generation prompt and take the reference as it is."""
    ref = row["reference"]
    if "prompt" in row and not row["prompt"][-1:].isspace() and not ref[:1].isspace():
        return " " + ref
    return ref


def output_text(tok, token_ids, stop: list[str]) -> str:
    """The generated tokens as text, cut at the first of each stop string."""
    text = tok.decode(token_ids, skip_special_tokens=True)
    for s in stop:
        text = text.split(s, 1)[0]
    return text


def row_id(row: dict) -> str:
    key = {k: row.get(k) for k in ("prompt", "messages", "reference", "metric")}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def score_validation(rows: list[dict], texts: list[str], cfg, out: Path, scores) -> dict:
    """Each output scored by its row's metric, into `scores`; the outputs written to validation_outputs.jsonl. A row whose
    pattern runs past REGEX_TIMEOUT_S scores 0 and is named (file:line) under `timed_out`."""
    per_row, by_metric, timed_out = [], {}, []
    with open(out / "validation_outputs.jsonl", "w") as f:
        for row, text in zip(rows, texts):
            entry = {"line": row["_line"], "metric": row["metric"], "reference": row.get("reference"), "output": text}
            try:
                score = score_output(text, row)
            except PatternTimeout as e:
                score, entry["timed_out"] = 0.0, True
                timed_out.append(str(e))
            per_row.append(score)
            by_metric.setdefault(row["metric"], []).append(score)
            f.write(json.dumps({**entry, "score": score}, ensure_ascii=False) + "\n")
    metric = cfg.metric if set(by_metric) == {cfg.metric} else "mixed"
    scores.per_example[f"validation/{metric}"] = per_row
    scores.ids["validation"] = [row_id(r) for r in rows]
    result = {"metric": metric, "score": sum(per_row) / len(per_row), "n": len(per_row)}
    if metric == "mixed":
        result["by_metric"] = {m: {"score": sum(v) / len(v), "n": len(v)} for m, v in sorted(by_metric.items())}
    if timed_out:
        result["timed_out"] = timed_out
    return result
