"""Package stage: one Hugging Face model directory per artifact, with a model card and a manifest. It holds the quantized
weights as safetensors shards (re-sharded to `package.max_shard_size` when a file is larger, copied otherwise) with their
index, config.json with its quantization_config, generation_config.json, the tokenizer and its chat template, README.md
(the model card: what was done, accuracy against the baseline with confidence intervals, benchmark tables, the
`vllm serve` command the benchmark found best) and manifest.json (sha256 and size of every file, the resolved recipe,
stage keys, library versions, hardware, timings); no adapter files, no pickle weights. `quantpipe verify DIR` re-checks
a package against its manifest:

    quantpipe verify out/demo/packages/fp8
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from ...common.safetensors import read_header
from .. import StageError
from ..contract import PackageInput, Upstream
from .card import card_context, license_of, serve_command, write_card
from .verify import INDEX, MANIFEST, _read_json, build_manifest, verify_package

__all__ = ["run", "parse_size", "serve_command", "verify_package"]

TOKENIZER_FILES = {
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
}
# Files of a quantized directory that belong in the package besides the weights and the tokenizer.
# recipe.yaml is llm-compressor's record of what it applied: provenance users expect next to the weights.
CONFIG_FILES = ("config.json", "generation_config.json", "recipe.yaml")
SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def run(inp: PackageInput, src: Path, out: Path, upstream: dict[str, Upstream]) -> dict:
    """Build the package of the quantized model in `src` into `out`. `upstream` holds `quantize` (src), `merged`, `self`
    (this stage's own key) and, where the recipe has them, `evaluation`, `baseline_eval`, `benchmark`, `baseline_benchmark`."""
    src, out, merged = Path(src), Path(out), upstream["merged"].out
    artifact = inp.artifact.name
    config = _read_json(src / "config.json")
    if config is None:
        raise StageError(
            f"{src} has no readable config.json; the quantize stage output is incomplete: rebuild it with `--force quantize:{artifact}`"
        )
    if not config.get("quantization_config"):
        raise StageError(
            f"{src}/config.json has no quantization_config: it is not a quantized checkpoint; rebuild it with `--force quantize:{artifact}`"
        )
    max_shard = parse_size(inp.package.max_shard_size)

    weights = _write_weights(src, out, max_shard)
    copied, skipped = [], []
    for name in sorted(os.listdir(src)):
        p = src / name
        if not p.is_file() or name.endswith(".safetensors") or name == INDEX:
            continue
        if name in CONFIG_FILES or name in TOKENIZER_FILES or name.endswith(".tiktoken"):
            shutil.copyfile(p, out / name)
            copied.append(name)
        else:
            skipped.append(name)  # adapter files, pickle weights, caches, anything unexpected
    # The tokenizer (and generation config) may live only in the merged model: take them from there.
    for name in sorted(os.listdir(merged)) if merged.is_dir() else []:
        if (
            (merged / name).is_file()
            and not (out / name).exists()
            and (name in TOKENIZER_FILES or name == "generation_config.json" or name.endswith(".tiktoken"))
        ):
            shutil.copyfile(merged / name, out / name)
            copied.append(f"{name} (from the merged model)")
    tok_cfg = _read_json(out / "tokenizer_config.json") or {}
    has_template = (
        (out / "chat_template.jinja").is_file()
        or (out / "chat_template.json").is_file()
        or bool(tok_cfg.get("chat_template"))
    )
    if not any(
        (out / t).is_file() for t in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    ):
        raise StageError(
            f"neither {src} nor the merged model {merged} holds tokenizer files; save the tokenizer next to the base model"
        )

    stages = {
        role: upstream[role] if role in upstream else None
        for role in ("quantize", "merged", "evaluation", "baseline_eval", "benchmark", "baseline_benchmark")
    }
    ctx = card_context(inp, config, stages, weights)
    license_, license_source = license_of(inp)
    ctx["license"], ctx["license_source"] = license_, license_source
    ctx["has_chat_template"] = has_template
    write_card(inp, ctx, out / "README.md", license_)

    manifest = build_manifest(inp, out, src, stages, upstream.get("self"), weights, ctx)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    problems = verify_package(out)
    if problems:  # our own output must pass our own check, or the package is not published
        raise RuntimeError("the package failed its own verification: " + "; ".join(problems[:10]))
    return {
        "artifact": artifact,
        "files": len(manifest["files"]),
        "total_bytes": sum(f["size"] for f in manifest["files"].values()),
        "shards": weights["shards"],
        "resharded": weights["resharded"],
        "max_shard_bytes": max_shard,
        "largest_shard_bytes": weights["largest_shard_bytes"],
        "hardlinked_shards": weights["hardlinked_shards"],
        "license": license_,
        "license_source": license_source,
        "chat_template": has_template,
        "serve_command": ctx["serve"]["command"],
        "copied": copied,
        "skipped": skipped,
    }


# --- weights ----------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000, '512MiB' -> 536870912 (the units inp.package.max_shard_size allows)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]+)\s*", text)
    if not m or m.group(2).upper() not in SIZE_UNITS:
        raise StageError(f"package.max_shard_size {text!r} is not a size; write e.g. 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * SIZE_UNITS[m.group(2).upper()])


def _source_shards(src: Path) -> list[str]:
    index = _read_json(src / INDEX)
    if index and isinstance(index.get("weight_map"), dict):
        return sorted(set(index["weight_map"].values()))
    return sorted(p.name for p in src.glob("*.safetensors"))


def _write_weights(src: Path, out: Path, max_shard: int) -> dict:
    """Copy the safetensors shards (and index) when each fits `max_shard`, else re-shard them all."""
    files = _source_shards(src)
    if not files:
        raise StageError(f"{src} holds no *.safetensors weights; the quantize stage output is incomplete")
    headers = {}
    for name in files:
        if not (src / name).is_file():
            raise StageError(f"{src}/{INDEX} names {name}, which is missing; rebuild the quantize stage")
        headers[name] = read_header(src / name)
    data_bytes = {
        n: sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in h.items() if not k.startswith("__"))
        for n, h in headers.items()
    }
    if all(b <= max_shard for b in data_bytes.values()):
        linked = sum(_link_or_copy(src / name, out / name) for name in files)
        if (src / INDEX).is_file():
            shutil.copyfile(src / INDEX, out / INDEX)
        elif len(files) > 1:
            _write_index(
                out, {k: n for n, h in headers.items() for k in h if not k.startswith("__")}, sum(data_bytes.values())
            )
        return {
            "resharded": False,
            "shards": len(files),
            "files": files,
            "largest_shard_bytes": max(data_bytes.values()),
            "hardlinked_shards": linked,
        }
    return _reshard(src, out, headers, max_shard)


def _link_or_copy(src: Path, dst: Path) -> bool:
    """A hard link to a weight shard of the quantize stage's cache entry, else a copy; True when linked. Cache entries are
    never written after their commit and the cache checks each entry's files on use, so a shard damaged in one is found
    in both and both are rebuilt (published packages are copies: users may edit those). An 8B model's shards are 5-9 GB,
    10-20 s to copy on an H200 host."""
    try:
        os.link(src, dst)
        return True
    except OSError:  # another filesystem, or one without hard links
        shutil.copyfile(src, dst)
        return False


def _reshard(src: Path, out: Path, headers: dict, max_shard: int) -> dict:
    """Split into shards of at most `max_shard` tensor bytes with huggingface_hub's planner, loading one shard at a time."""
    from huggingface_hub import split_state_dict_into_shards_factory
    from safetensors import safe_open
    from safetensors.torch import save_file

    where = {}  # tensor name -> (source file, header entry)
    metadata = {"format": "pt"}
    for name, h in headers.items():
        metadata |= h.get("__metadata__") or {}
        for k, v in h.items():
            if not k.startswith("__"):
                where[k] = (name, v)
    plan = split_state_dict_into_shards_factory(
        {k: v[1] for k, v in sorted(where.items())},
        get_storage_size=lambda e: e["data_offsets"][1] - e["data_offsets"][0],
        get_storage_id=lambda e: None,  # safetensors files never alias storage
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=max_shard,
    )
    largest = 0
    for shard, names in plan.filename_to_tensors.items():
        tensors, by_file = {}, {}
        for k in names:
            by_file.setdefault(where[k][0], []).append(k)
        for file, keys in by_file.items():
            with safe_open(src / file, framework="pt") as f:
                for k in keys:
                    tensors[k] = f.get_tensor(k)
        save_file(tensors, str(out / shard), metadata=metadata)
        largest = max(largest, sum(where[k][1]["data_offsets"][1] - where[k][1]["data_offsets"][0] for k in names))
        del tensors
    if plan.is_sharded:
        _write_index(out, plan.tensor_to_filename, plan.metadata["total_size"])
    return {
        "resharded": True,
        "shards": len(plan.filename_to_tensors),
        "files": sorted(plan.filename_to_tensors),
        "largest_shard_bytes": largest,
        "hardlinked_shards": 0,
    }


def _write_index(out: Path, weight_map: dict, total_size: int) -> None:
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
