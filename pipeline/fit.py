"""Does the recipe fit the model? Read from config.json, the safetensors headers and tokenizer files, without torch.

A group size that does not divide a layer's input width (llm-compressor fails inside `oneshot`, listing every layer), a
workload longer than the engine's max_model_len or the model's context (vLLM fails after the server started), a
max_model_len or tensor_parallel_size vLLM refuses, calibration longer than the context, and a needed but missing
tokenizer or chat template are bad input (rows as the tokenizer makes them: `quantpipe.tokenized`), refused by `quantpipe check` and before `quantpipe run` writes anything:

    from quantpipe.fit import problems
    problems(recipe, Path(recipe.base.model))   # -> ["artifacts.0.group_size: 128 does not divide ...", ...]
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from .common.hf_config import read_config, text_part
from .common.safetensors import read_header, tensors
from .common.shape import CONTEXT_KEY, ModelShape

# vLLM's keys for a model's context length (ModelArchConfigConvertor.derive_max_model_len_and_key, vLLM 0.32): the smallest present wins
CONTEXT_KEYS = (
    CONTEXT_KEY,
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
VLLM_DEFAULT_LEN = 2048  # what vLLM assumes when config.json names no context length and max_model_len is unset
TOKENIZER_FILES = (
    "tokenizer_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
)  # as the merge stage looks for them


def problems(recipe, model_dir: Path) -> list[str]:
    """Every way the recipe does not fit the model in `model_dir` (the base model's local directory)."""
    if not (model_dir / "config.json").is_file():
        return []
    cfg = read_config(model_dir)
    if cfg is None:
        return [
            f"base.model: {model_dir / 'config.json'} cannot be read as a JSON object; re-save the model (save_pretrained) or fix the file"
        ]
    c = text_part(cfg)
    out = [p for i, a in enumerate(recipe.artifacts) if (p := group_size_problem(i, a, c, model_dir))]
    out += context_problems(recipe, c, tokenizer_dir(recipe, model_dir))
    return out


# --- group sizes --------------------------------------------------------------------------------


def _int(c: dict, key: str) -> int | None:
    v = c.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def layer_inputs(c: dict) -> dict[str, int]:
    """Input width of each Linear of a decoder layer (llama-style names) and lm_head, from config.json; {} when it does not say."""
    s = ModelShape.from_config(c)
    h, layers, heads = s.hidden, s.layers, s.heads
    if not h or not layers:
        return {}
    hd = s.exact_head_dim
    v_hd = _int(c, "v_head_dim") or hd  # MLA (DeepSeek) projects values to v_head_dim
    per_layer = {"self_attn.q_proj": h, "self_attn.k_proj": h, "self_attn.v_proj": h}
    if heads and v_hd:
        per_layer["self_attn.o_proj"] = heads * v_hd
    if s.intermediate:
        per_layer |= {"mlp.gate_proj": h, "mlp.up_proj": h, "mlp.down_proj": s.intermediate}
    if _int(c, "moe_intermediate_size"):
        per_layer |= {
            "mlp.experts.0.gate_proj": h,
            "mlp.experts.0.up_proj": h,
            "mlp.experts.0.down_proj": c["moe_intermediate_size"],
        }
    if _int(c, "shared_expert_intermediate_size"):
        per_layer["mlp.shared_expert.down_proj"] = c["shared_expert_intermediate_size"]
    out = {f"model.layers.{i}.{k}": w for i in range(layers) for k, w in per_layer.items()}
    out["lm_head"] = h
    return out


def _header_linears(model_dir: Path) -> dict[str, int]:
    """{module: input width} of every 2-D `.weight` in the safetensors headers that is not an embedding; {} when unreadable."""
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        try:
            for k, v in tensors(read_header(f)).items():
                shape = v.get("shape") if isinstance(v, dict) else None
                if (
                    k.endswith(".weight")
                    and isinstance(shape, list)
                    and len(shape) == 2
                    and not re.search(r"embed|\bwte\b|\bwpe\b", k)
                ):
                    out[k.removesuffix(".weight")] = int(shape[1])
        except (OSError, ValueError, TypeError):
            return {}
    return out


def _matches(name: str, entry: str) -> bool | None:
    """compressed-tensors' rule: `re:` + re.match, a module name exactly, or a class name (only `Linear` is known here: None)."""
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    if entry == "Linear":
        return True
    if "." not in entry and entry[:1].isupper():
        return None  # a class name other than Linear: which modules it covers is not knowable from the files
    return entry == name


def group_size_problem(i: int, a, c: dict, model_dir: Path) -> str | None:
    """Why artifact `a`'s group size does not divide the input width of a layer it quantizes, or None."""
    from .recipe import GROUPED, group_sizes

    g = getattr(a, "group_size", None)
    if a.method not in GROUPED or not g:
        return None
    widths = layer_inputs(c)
    if not widths:
        return None
    odd = {w for w in widths.values() if w % g}
    if not odd:
        return None
    # the real modules where the headers list them (any architecture's naming), else the llama-style ones of config.json
    header = _header_linears(model_dir)
    modules = {m: w for m, w in (header or widths).items() if w in odd}
    hit: dict[int, set[str]] = {}
    for m, w in modules.items():
        target = [_matches(m, t) for t in a.targets]
        ignored = [_matches(m, t) for t in a.ignore]
        if None in ignored or (None in target and not any(target)):
            return None  # class names beyond Linear: leave it to llm-compressor rather than guess
        if any(target) and not any(ignored):
            hit.setdefault(w, set()).add(m.rsplit(".", 1)[-1])
    if not hit:
        return None
    all_widths = set(widths.values()) - {w for w in odd if w not in hit}
    ok = [s for s in group_sizes(a.method) if all(w % s == 0 for w in all_widths)]
    what = "; ".join(f"{w} (the input of {', '.join(sorted(names))})" for w, names in sorted(hit.items()))
    fix = (
        f"use group_size {' or '.join(map(str, ok))}"
        if ok
        else f"no group size the schema takes ({', '.join(map(str, group_sizes(a.method)))}) divides them"
    )
    if a.method == "gptq":
        fix += ", or group_size: null (one scale per output channel)"
    return (
        f"artifacts.{i}.group_size: {g} does not divide the input width of layers it quantizes: {what}; "
        f"{fix}, or list those layers in `ignore`"
    )


# --- lengths ------------------------------------------------------------------------------------


def model_context(c: dict) -> tuple[int, str, float] | None:
    """(length, where it comes from, RoPE factor) of the model's context as vLLM derives it, or None if config.json has none.
    The smallest length key times a RoPE factor, taken generously (yarn's too, which some vLLM versions apply)."""
    found = [
        (int(c[k]), k)
        for k in CONTEXT_KEYS
        if isinstance(c.get(k), (int, float)) and not isinstance(c.get(k), bool) and c[k] > 0
    ]
    if not found:
        return None
    n, key = min(found)
    rope = c.get("rope_scaling") or c.get("rope_parameters")
    params = (
        [rope]
        if isinstance(rope, dict) and ("rope_type" in rope or "type" in rope)
        else [v for v in rope.values() if isinstance(v, dict)]
        if isinstance(rope, dict)
        else []
    )
    for rp in params:
        kind, factor = rp.get("rope_type") or rp.get("type"), rp.get("factor")
        if (
            kind not in (None, "default", "llama3", "su", "longrope")
            and isinstance(factor, (int, float))
            and factor > 1
        ):
            return int(n * factor), f"{key} {n} x RoPE factor {factor:g}", float(factor)
    return n, f"{key} {n}", 1.0


def tokenizer_dir(recipe, model_dir: Path) -> Path:
    """Where the merged model's tokenizer comes from: the last adapter that ships one, else the base (as the merge stage does)."""
    for a in reversed(recipe.adapters):
        if any((Path(a.path) / f).is_file() for f in TOKENIZER_FILES):
            return Path(a.path)
    return model_dir


def _tokenizer_max(tok_dir: Path) -> int | None:
    try:
        n = json.loads((tok_dir / "tokenizer_config.json").read_text()).get("model_max_length")
    except (OSError, ValueError, AttributeError):
        return None
    return int(n) if isinstance(n, (int, float)) and not isinstance(n, bool) and 0 < n < 1e12 else None


def context_problems(recipe, c: dict, tok_dir: Path) -> list[str]:
    """Lengths beyond what the engine or the model's context takes, and a tensor_parallel_size that does not divide the heads."""
    from .common.vllm_support import variant_engines

    out = []
    ctx = model_context(c)
    cal = recipe.calibration
    if cal and ctx and cal.max_seq_len > ctx[0]:
        out.append(
            f"calibration.max_seq_len: {cal.max_seq_len} is longer than the model's context ({ctx[1]} in config.json), "
            f"positions it was never trained on; use at most {ctx[0]}"
        )
    fid = recipe.evaluation.fidelity
    if fid and ctx and fid.seq_len > ctx[0]:
        out.append(
            f"evaluation.fidelity.seq_len: {fid.seq_len} is longer than the model's context ({ctx[1]} in config.json); "
            f"use at most {ctx[0]}"
        )
    b = recipe.benchmark
    if not b.enabled:
        return out
    allow_long = os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "").lower() in ("1", "true")
    tok_max = _tokenizer_max(tok_dir)
    reported: set = set()
    heads = ModelShape.from_config(c).heads
    for j, (vname, e) in enumerate(variant_engines(recipe)):
        tp = e.tensor_parallel_size
        if tp and heads and heads % tp:
            own = j > 0 and b.variants[j - 1].engine.tensor_parallel_size is not None
            tfield = (
                f"benchmark.variants.{j - 1}.engine.tensor_parallel_size"
                if own
                else "benchmark.engine.tensor_parallel_size"
            )
            if tfield not in reported:
                reported.add(tfield)
                fits = [n for n in range(1, min(heads, 64) + 1) if heads % n == 0]
                out.append(
                    f"{tfield}: {tp} does not divide the model's {heads} attention heads (config.json), which vLLM "
                    f"refuses; use one of {', '.join(map(str, fits))}"
                )
        own = j > 0 and b.variants[j - 1].engine.max_model_len is not None
        field = f"benchmark.variants.{j - 1}.engine.max_model_len" if own else "benchmark.engine.max_model_len"
        if e.max_model_len is not None:
            if ctx and e.max_model_len > ctx[0] and not allow_long:
                if field not in reported:
                    reported.add(field)
                    out.append(
                        f"{field}: {e.max_model_len} is longer than the model's context ({ctx[1]} in config.json), and vLLM "
                        f"refuses to start with it; use at most {ctx[0]}"
                    )
                continue
            limit, why, fix = (
                e.max_model_len,
                f"{field} is {e.max_model_len}" + (f" (variant {vname!r})" if j else ""),
                f"raise {field}",
            )
        elif (
            ctx and ctx[2] == 1.0 and tok_max and tok_max < ctx[0]
        ):  # vLLM scales the tokenizer's limit by RoPE too: left alone then
            limit, why = (
                tok_max,
                f"with no max_model_len set vLLM takes the tokenizer's model_max_length, {tok_max} ({tok_dir / 'tokenizer_config.json'})",
            )
            fix = "set benchmark.engine.max_model_len"
        elif ctx:
            limit, why, fix = ctx[0], "", ""
        else:
            limit, why = (
                VLLM_DEFAULT_LEN,
                f"config.json names no context length, so with no max_model_len set vLLM assumes {VLLM_DEFAULT_LEN}",
            )
            fix = "set benchmark.engine.max_model_len"
        for k, w in enumerate(b.workloads):
            need = w.max_tokens
            if need is None or need <= limit or k in reported:
                continue
            reported.add(k)
            parts = (
                f"prefix_len {w.prefix_len} + " if w.prefix_len else ""
            ) + f"input_len {w.input_len} + output_len {w.output_len}"
            head = f"benchmark.workloads.{k} ({w.name!r}): needs {need} tokens per sequence ({parts})"
            if ctx and need > ctx[0]:
                out.append(
                    f"{head}, more than the model's context ({ctx[1]} in config.json); shorten it to at most {ctx[0]} tokens"
                )
            else:
                out.append(f"{head} but {why}; shorten the workload, or {fix} to at least {need}")
    return out


# --- chat templates -------------------------------------------------------------------------------


def has_chat_template(tok_dir: Path) -> bool:
    """A chat template in tokenizer_config.json, chat_template.jinja or chat_template.json (what transformers loads)."""
    if (tok_dir / "chat_template.jinja").is_file() or (tok_dir / "chat_template.json").is_file():
        return True
    try:
        t = json.loads((tok_dir / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return False
    return bool(t)


def chat_template_problems(recipe, model_dir: Path, needs: list[str]) -> list[str]:
    """`needs`: what asks for a chat template (field names); one problem when the tokenizer has none."""
    if not needs:
        return []
    tok = tokenizer_dir(recipe, model_dir)
    if has_chat_template(tok):
        return []
    has_tok = any((tok / f).is_file() for f in TOKENIZER_FILES)
    what = "has no chat template" if has_tok else "has no tokenizer files (so no chat template)"
    return [
        f"{needs[0]}: needs the model's chat template, but {tok} {what}"
        + (f" (also needed by {', '.join(needs[1:])})" if needs[1:] else "")
        + "; add one (chat_template.jinja next to the tokenizer), or give plain-text rows and turn chat templating off"
    ]


# --- the tokenizer --------------------------------------------------------------------------------


def tokenizer_problems(recipe, model_dir: Path) -> list[str]:
    """A tokenizer missing where a stage needs one: quantize tokenizes the calibration, evaluate its prompts and texts,
    vLLM serves with it and the package ships it."""
    needs = [
        what
        for what, needed in (
            ("calibration (quantize tokenizes it)", recipe.calibration is not None),
            (
                "evaluation",
                bool(recipe.evaluation.lm_eval or recipe.evaluation.validation or recipe.evaluation.fidelity),
            ),
            ("benchmark (vLLM serves with it)", recipe.benchmark.enabled),
            ("package (ships it)", recipe.package.enabled),
        )
        if needed
    ]
    tok = tokenizer_dir(recipe, model_dir)
    if not needs or any((tok / f).is_file() for f in TOKENIZER_FILES):
        return []
    return [
        f"base.model: {tok} has no tokenizer files ({', '.join(TOKENIZER_FILES)}), which {'; '.join(needs)} "
        "need; save the tokenizer next to the model (tokenizer.save_pretrained), or ship it in the last adapter's folder"
    ]
