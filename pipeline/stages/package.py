"""Package stage: one Hugging Face model directory per artifact, with a model card and a manifest.

The package holds the quantized weights as safetensors shards (re-sharded to
`package.max_shard_size` when a file is larger, copied otherwise) with their index, config.json with
its quantization_config, generation_config.json, the tokenizer and its chat template, README.md (a
model card: what was done, accuracy against the baseline with confidence intervals, benchmark
tables, the `vllm serve` command the benchmark found best) and manifest.json (sha256 and size of
every file, the resolved recipe, stage keys, library versions, hardware, timings). Nothing else:
no adapter files, no pickle weights. `quantpipe verify DIR` re-checks a package against its manifest:

    quantpipe verify out/demo/packages/fp8
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import struct
from pathlib import Path

from . import StageError

MANIFEST = "manifest.json"
INDEX = "model.safetensors.index.json"
TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
TOKENIZER_FILES = {
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
    "chat_template.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json", "vocab.txt", "merges.txt",
}
# Files of a quantized directory that belong in the package besides the weights and the tokenizer.
# recipe.yaml is llm-compressor's record of what it applied: provenance users expect next to the weights.
CONFIG_FILES = ("config.json", "generation_config.json", "recipe.yaml")
SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
# Tensor-name suffixes of compressed-tensors' quantization parameters (not model weights proper).
QUANT_PARAMS = ("weight_scale", "weight_zero_point", "weight_global_scale", "weight_g_idx", "weight_shape", "weight_packed",
                "input_scale", "input_zero_point", "input_global_scale", "output_scale", "k_scale", "v_scale")
SAFETENSORS_DTYPES = {"BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F4", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64", "C64"}
TORCH_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "half": "F16", "float": "F32"}


def run(recipe, src: Path, out: Path, artifact: str, merged: Path, evaluation: Path | None = None, baseline_eval: Path | None = None,
        benchmark: Path | None = None, baseline_benchmark: Path | None = None) -> dict:
    """Build the package of the quantized model in `src` into `out`. Returns metrics for the run log."""
    src, out, merged = Path(src), Path(out), Path(merged)
    config = _read_json(src / "config.json")
    if config is None:
        raise StageError(f"{src} has no readable config.json; the quantize stage output is incomplete: rebuild it with `--force quantize:{artifact}`")
    if not config.get("quantization_config"):
        raise StageError(f"{src}/config.json has no quantization_config: it is not a quantized checkpoint; rebuild it with `--force quantize:{artifact}`")
    max_shard = parse_size(recipe.package.max_shard_size)

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
        if (merged / name).is_file() and not (out / name).exists() and (name in TOKENIZER_FILES or name == "generation_config.json" or name.endswith(".tiktoken")):
            shutil.copyfile(merged / name, out / name)
            copied.append(f"{name} (from the merged model)")
    tok_cfg = _read_json(out / "tokenizer_config.json") or {}
    has_template = (out / "chat_template.jinja").is_file() or (out / "chat_template.json").is_file() or bool(tok_cfg.get("chat_template"))
    if not any((out / t).is_file() for t in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")):
        raise StageError(f"neither {src} nor the merged model {merged} holds tokenizer files; save the tokenizer next to the base model")

    stages = {name: stage_record(p) for name, p in {"quantize": src, "merge": merged, "evaluation": evaluation, "baseline_eval": baseline_eval,
                                                    "benchmark": benchmark, "baseline_benchmark": baseline_benchmark}.items()}
    ctx = card_context(recipe, artifact, config, stages, weights)
    license_, license_source = _license(recipe)
    ctx["license"], ctx["license_source"] = license_, license_source
    ctx["has_chat_template"] = has_template
    write_card(recipe, artifact, ctx, out / "README.md", license_)

    manifest = build_manifest(recipe, artifact, out, src, stages, weights, ctx)
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
    """'5GB' -> 5_000_000_000, '512MiB' -> 536870912 (the units recipe.package.max_shard_size allows)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]+)\s*", text)
    if not m or m.group(2).upper() not in SIZE_UNITS:
        raise StageError(f"package.max_shard_size {text!r} is not a size; write e.g. 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * SIZE_UNITS[m.group(2).upper()])


def read_header(path: Path) -> dict:
    """The JSON header of a safetensors file. By hand (8-byte length + JSON) so that `verify` needs no
    framework and reports a truncated or garbled file as a problem instead of crashing."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("shorter than a safetensors header")
        n = struct.unpack("<Q", head)[0]
        if n > 100 * 2**20 or n > path.stat().st_size - 8:
            raise ValueError(f"header length {n} is impossible for a {path.stat().st_size}-byte file")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    header["__size__"] = 8 + n
    return header


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
    data_bytes = {n: sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in h.items() if not k.startswith("__")) for n, h in headers.items()}
    if all(b <= max_shard for b in data_bytes.values()):
        linked = sum(_link_or_copy(src / name, out / name) for name in files)
        if (src / INDEX).is_file():
            shutil.copyfile(src / INDEX, out / INDEX)
        elif len(files) > 1:
            _write_index(out, {k: n for n, h in headers.items() for k in h if not k.startswith("__")}, sum(data_bytes.values()))
        return {"resharded": False, "shards": len(files), "files": files, "largest_shard_bytes": max(data_bytes.values()), "hardlinked_shards": linked}
    return _reshard(src, out, headers, max_shard)


def _link_or_copy(src: Path, dst: Path) -> bool:
    """A hard link to a weight shard of the quantize stage's cache entry, else a copy; True when linked.
    Cache entries are never written after their commit, and the cache checks each entry's files on use,
    so a shard damaged in one is found damaged in both and both are rebuilt. (Published packages are
    copies: users may edit those.) An 8B model's shards are 5-9 GB, 10-20 s to copy on an H200 host."""
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
    return {"resharded": True, "shards": len(plan.filename_to_tensors), "files": sorted(plan.filename_to_tensors), "largest_shard_bytes": largest,
            "hardlinked_shards": 0}


def _write_index(out: Path, weight_map: dict, total_size: int) -> None:
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")


# --- what the other stages measured ------------------------------------------------------------


def stage_record(out: Path | None) -> dict:
    """What the runner recorded for a stage output `<cache>/stages/<kind>/<name>/<key>/out`: its metrics,
    wall time and key (from the cache entry's marker), or what the stage left in `out/metrics.json`."""
    if out is None:
        return {}
    out = Path(out)
    rec = _read_json(out.parent / "entry.json") or {}
    if not rec.get("metrics"):
        for name in ("metrics.json", "evaluation.json", "benchmark.json", "results.json"):
            m = _read_json(out / name)
            if isinstance(m, dict):
                rec = {**rec, "metrics": m}
                break
    sid = stage_id(out)
    if sid:
        rec.setdefault("stage", sid[0])
        rec.setdefault("key", sid[1])
    if not isinstance(rec.get("metrics"), dict):
        rec["metrics"] = {}
    return rec


def stage_id(out: Path) -> tuple[str, str] | None:
    """('quantize:awq', key) from `<cache>/stages/quantize/awq/<key>/out`; None for a path outside a cache."""
    parts = Path(out).parts
    if len(parts) < 4 or parts[-1] != "out" or "stages" not in parts[:-3]:
        return None
    i = len(parts) - 1 - parts[::-1].index("stages")
    key = parts[-2]
    m = re.match(r"^\.(\w+)\.tmp-", key)  # the package's own folder while it is being built
    return ":".join(parts[i + 1:-2]), m.group(1) if m else key


# --- the model card ---------------------------------------------------------------------------


def serve_command(recipe, artifact: str, bench: dict) -> dict:
    """The `vllm serve` line with the engine arguments of the variant the benchmark found best: the effective
    arguments it served with (benchmark metrics `variants`), else the recipe's engine with that variant laid over it."""
    from .benchmark import engine_flags, variant_engines

    best = bench.get("best") if isinstance(bench.get("best"), dict) else {}
    variant = best.get("variant")
    measured = (bench.get("variants") or {}).get(variant or "default") if isinstance(bench.get("variants"), dict) else None
    if isinstance(measured, dict) and isinstance(measured.get("engine"), dict) and measured["engine"]:
        engine, source = dict(measured["engine"]), "measured"
    else:
        engine, source = dict(variant_engines(recipe)).get(variant or "default", recipe.benchmark.engine).model_dump(), "recipe"
        if recipe.base.trust_remote_code:
            engine["trust_remote_code"] = True
    args = engine_flags({k: v for k, v in engine.items() if k != "lora_flags" and v != []})
    return {"variant": variant, "concurrency": best.get("concurrency"), "reason": best.get("reason"), "engine": engine, "source": source,
            "measured": bool(bench), "command": shlex.join(["vllm", "serve", f"./{artifact}", *args])}


def card_context(recipe, artifact: str, config: dict, stages: dict, weights: dict) -> dict:
    """Everything the model card shows, from the recipe and the measured metrics (missing ones stay None)."""
    from ..envs import git_commit, hardware, versions
    from ..cache import hash_json

    art = next((a for a in recipe.artifacts if a.name == artifact), None)
    q = stages["quantize"].get("metrics", {})
    ev = stages["evaluation"].get("metrics", {})
    bev = stages["baseline_eval"].get("metrics", {})
    bench = stages["benchmark"].get("metrics", {})
    bbench = stages["baseline_benchmark"].get("metrics", {})
    cal = recipe.calibration
    base = recipe.base.model
    base_ref = base if not recipe.base.is_local else Path(base).name
    qc = config.get("quantization_config") or {}
    def key(r):
        return tuple(str(r.get(k)) for k in ("variant", "workload", "concurrency"))

    base_rows = {key(r): r for r in bbench.get("results") or [] if isinstance(r, dict)}
    bench_rows = []
    for r in [r for r in bench.get("results") or [] if isinstance(r, dict)]:
        b = base_rows.get(key(r))
        speedup = None
        if b and isinstance(b.get("output_throughput"), (int, float)) and isinstance(r.get("output_throughput"), (int, float)) and b["output_throughput"]:
            speedup = r["output_throughput"] / b["output_throughput"]
        bench_rows.append({**r, "speedup": speedup})
    gates = _gates(recipe, ev)
    return {
        "name": f"{recipe.name}-{artifact}",
        "notes": recipe.notes,
        "artifact": artifact,
        "method": getattr(art, "method", q.get("method")),
        "scheme": q.get("scheme"),
        "settings": {k: v for k, v in art.model_dump(mode="json", exclude={"name", "method"}).items() if v is not None} if art else {},
        "format": qc.get("format"),
        "quant_method": qc.get("quant_method"),
        "base_model": base,
        "base_ref": base_ref,
        "base_is_local": recipe.base.is_local,
        "revision": recipe.base.revision,
        "adapters": [{"name": Path(a.path).name, "weight": a.weight} for a in recipe.adapters],
        "calibration": {
            "sources": [{"ref": s.dataset or Path(s.path).name, "split": s.split if s.dataset else None, "weight": s.weight} for s in cal.sources] if cal else [],
            "num_samples": cal.num_samples if cal else None, "max_seq_len": cal.max_seq_len if cal else None, "seed": cal.seed if cal else None,
            "sha256": q.get("calibration_sha256"), "n_samples": q.get("n_calibration_samples"),
        },
        "size_bytes": q.get("size_bytes"), "baseline_size_bytes": q.get("baseline_size_bytes"), "compression": q.get("compression"),
        "weights": weights, "max_shard_size": recipe.package.max_shard_size,
        "eval": {
            "comparison": ev.get("comparison") or [],
            "validation": ev.get("validation"), "baseline_validation": bev.get("validation"),
            "fidelity": ev.get("fidelity"), "settings": ev.get("settings") or {},
        },
        "gates": gates,
        "bench": {
            "servable": bench.get("servable"), "reason": bench.get("reason"), "status_note": bench.get("status_note"),
            "platform": bench.get("platform"), "rows": bench_rows, "offline": bench.get("offline"), "baseline_offline": bbench.get("offline"),
            "memory": bench.get("memory"), "best": bench.get("best"), "measured": bool(bench),
        },
        "serve": serve_command(recipe, artifact, bench),
        "slo": recipe.benchmark.slo.model_dump(),
        "provenance": {
            "quantpipe_commit": git_commit(), "hardware": hardware(), "versions": {e: versions(e) for e in ("quantize", "serve")},
            "recipe_hash": hash_json(recipe.model_dump(mode="json"))[:16], "recipe_name": recipe.name,
        },
        "trust_remote_code": recipe.base.trust_remote_code,
    }


def _gates(recipe, ev: dict) -> dict | None:
    """The recipe's release gates applied to this artifact's evaluation (None when not evaluated)."""
    g = recipe.evaluation.gates
    if not ev:
        return None
    try:
        from .evaluate import check_gates
    except ImportError:
        return None
    failures = check_gates(g, ev)
    return {"status": "FAIL" if failures else "PASS", "failures": failures, "thresholds": {k: v for k, v in g.model_dump().items() if v not in (None, {})}}


def _license(recipe) -> tuple[str | None, str]:
    """(license, where it came from): the recipe's package.license, else the base model card's front matter."""
    if recipe.package.license:
        return recipe.package.license, "recipe"
    readme = Path(recipe.base.model) / "README.md"
    if recipe.base.is_local and readme.is_file():
        try:
            from huggingface_hub import ModelCard

            lic = ModelCard.load(readme, ignore_metadata_errors=True).data.to_dict().get("license")
            if lic:
                return str(lic), "base model card"
        except Exception:  # a malformed base card must not stop packaging; the license is then unknown
            pass
    return None, "unknown"


def write_card(recipe, artifact: str, ctx: dict, path: Path, license_: str | None) -> None:
    from huggingface_hub import ModelCard, ModelCardData

    datasets = [s.dataset for s in recipe.calibration.sources if s.dataset] if recipe.calibration else []
    tags = ["quantpipe", "quantized", ctx["method"], "compressed-tensors", "llmcompressor", "vllm"]
    if ctx.get("scheme"):
        tags.append(str(ctx["scheme"]).lower())
    data = ModelCardData(
        base_model=ctx["base_ref"], base_model_relation="quantized", library_name="transformers", license=license_,
        datasets=datasets or None, tags=list(dict.fromkeys(t for t in tags if t)), model_name=ctx["name"],
    )
    card = ModelCard.from_template(data, template_str=_template("model_card.md.j2"), **ctx, fmt=fmt, human_bytes=human_bytes, md=md_cell)
    path.write_text(str(card).rstrip() + "\n")


def _template(name: str) -> str:
    return (TEMPLATES / name).read_text()


def fmt(v, digits: int = 3) -> str:
    """A number for a table: fixed decimals, scientific when tiny or huge, '—' when not measured."""
    if v is None or (isinstance(v, float) and (v != v or v in (float("inf"), float("-inf")))):
        return "—"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int) or v == 0:
        return str(v)
    if abs(v) < 1e-3 or abs(v) >= 1e6:
        return f"{v:.{digits}g}"
    return f"{v:.{digits}f}"


def human_bytes(n) -> str:
    if not isinstance(n, (int, float)):
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def md_cell(v) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


# --- manifest and verification ------------------------------------------------------------------


def build_manifest(recipe, artifact: str, out: Path, src: Path, stages: dict, weights: dict, ctx: dict) -> dict:
    from ..cache import file_sha256, recorded_hashes

    known = recorded_hashes([src])  # the shards hard-linked from the quantize entry: hashed at its commit
    files = {}
    for p in sorted(out.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            files[str(p.relative_to(out))] = {"size": p.stat().st_size, "sha256": file_sha256(p, known)}
    keys = {rec["stage"]: rec["key"] for rec in stages.values() if rec.get("stage")}
    own = stage_id(out)
    if own:
        keys[own[0]] = own[1]
    timings = {rec["stage"]: rec.get("wall_s") or rec.get("metrics", {}).get("wall_s") for rec in stages.values() if rec.get("stage")}
    return {
        "format": "quantpipe-package/1",
        "artifact": artifact,
        "name": ctx["name"],
        "files": files,
        "weights": {"shards": weights["files"], "resharded": weights["resharded"], "max_shard_size": recipe.package.max_shard_size},
        "recipe": recipe.model_dump(mode="json"),
        "recipe_hash": ctx["provenance"]["recipe_hash"],
        "stage_keys": keys,
        "timings_s": timings,
        "quantpipe": {"git_commit": ctx["provenance"]["quantpipe_commit"]},
        "versions": ctx["provenance"]["versions"],
        "hardware": ctx["provenance"]["hardware"],
        "trust_remote_code": recipe.base.trust_remote_code,
        "allow_pickle": recipe.base.allow_pickle,
        "license": ctx.get("license"),
        "serve_command": ctx["serve"]["command"],
    }


def verify_package(dir: Path) -> list[str]:
    """Problems with a package (each naming the file); [] when every file matches manifest.json and the
    config, index and safetensors headers agree."""
    root = Path(dir)
    if not root.is_dir():
        return [f"{root}: not a directory"]
    manifest = _read_json(root / MANIFEST)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return [f"{MANIFEST}: missing or unreadable; this is not a quantpipe package (or the manifest was damaged)"]
    from ..cache import sha256_file

    problems = []
    recorded = manifest["files"]
    present = {str(p.relative_to(root)) for p in root.rglob("*") if (p.is_file() or p.is_symlink()) and p.name != MANIFEST}
    for rel in sorted(set(recorded) - present):
        problems.append(f"{rel}: missing (listed in {MANIFEST})")
    for rel in sorted(present - set(recorded)):
        problems.append(f"{rel}: extra file, not in {MANIFEST}")
    for rel in sorted(set(recorded) & present):
        p, rec = root / rel, recorded[rel]
        if p.is_symlink():
            problems.append(f"{rel}: is a symbolic link; a package holds plain files")
        elif p.stat().st_size != rec.get("size"):
            problems.append(f"{rel}: size {p.stat().st_size} != {rec.get('size')} in {MANIFEST}")
        elif sha256_file(p) != rec.get("sha256"):
            problems.append(f"{rel}: content changed (sha256 differs from {MANIFEST})")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        if name in present:
            problems.append(f"{name}: adapter files do not belong in a merged, quantized package")
    problems += check_structure(root)
    return problems


def check_structure(root: Path) -> list[str]:
    """Cheap consistency checks: config.json, the index against the shards' headers, dtypes against the quantization config."""
    problems = []
    config = _read_json(root / "config.json")
    if not isinstance(config, dict):
        return ["config.json: missing or not valid JSON"]
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        problems.append("config.json: no quantization_config; the package must describe how its weights are quantized")
        qc = {}
    shards = sorted(p.name for p in root.glob("*.safetensors"))
    if not shards:
        return problems + ["(weights): no *.safetensors file in the package"]
    headers = {}
    for name in shards:
        try:
            h = read_header(root / name)
        except (ValueError, OSError) as e:
            problems.append(f"{name}: unreadable safetensors header ({e})")
            continue
        size = (root / name).stat().st_size
        for k, v in h.items():
            if k.startswith("__"):
                continue
            if not isinstance(v, dict) or v.get("dtype") not in SAFETENSORS_DTYPES or len(v.get("data_offsets") or []) != 2:
                problems.append(f"{name}: tensor {k} has a malformed header entry")
            elif h["__size__"] + v["data_offsets"][1] > size:
                problems.append(f"{name}: tensor {k} extends past the end of the file (truncated?)")
        headers[name] = h
    index = _read_json(root / INDEX) if (root / INDEX).exists() else None
    if (root / INDEX).exists() and not isinstance(index, dict):
        problems.append(f"{INDEX}: not valid JSON")
    if isinstance(index, dict):
        wm = index.get("weight_map")
        if not isinstance(wm, dict):
            problems.append(f"{INDEX}: no weight_map")
            wm = {}
        for tensor, shard in sorted(wm.items()):
            if shard not in shards:
                problems.append(f"{shard}: missing, named in {INDEX} (for {tensor})")
            elif shard in headers and tensor not in headers[shard]:
                problems.append(f"{shard}: has no tensor {tensor}, which {INDEX} places there")
        for shard, h in headers.items():
            for tensor in h:
                if not tensor.startswith("__") and wm.get(tensor) != shard:
                    problems.append(f"{shard}: tensor {tensor} is not mapped to it in {INDEX}")
                    break
    elif len(shards) > 1:
        problems.append(f"{INDEX}: missing, yet there are {len(shards)} safetensors files")
    problems += _check_quantized_dtypes(config, qc, headers)
    return problems


def _check_quantized_dtypes(config: dict, qc: dict, headers: dict) -> list[str]:
    """The tensors look like what config.json's quantization_config and dtype describe (compressed-tensors formats)."""
    tensors = {k: (shard, v) for shard, h in headers.items() for k, v in h.items() if not k.startswith("__")}
    if not tensors:
        return []
    problems = []
    fmt_ = qc.get("format")
    if qc.get("quant_method") == "compressed-tensors":
        expected = {"pack-quantized": ("weight_packed", {"I32"}), "float-quantized": ("weight", {"F8_E4M3"}),
                    "int-quantized": ("weight", {"I8"}), "naive-quantized": ("weight", {"I8", "F8_E4M3"})}.get(fmt_)
        if expected:
            suffix, dtypes = expected
            quantized = [k for k, (s, v) in tensors.items() if k.endswith("." + suffix) and v["dtype"] in dtypes]
            if not quantized:
                problems.append(f"config.json: quantization format {fmt_!r} but no {'/'.join(sorted(dtypes))} `{suffix}` tensor in the shards")
            for k in quantized:
                mod = k.rsplit(".", 1)[0]
                if mod + ".weight_scale" not in tensors:
                    problems.append(f"{tensors[k][0]}: {k} is quantized but {mod}.weight_scale is missing")
                    break
    want = TORCH_DTYPES.get(str(config.get("dtype") or config.get("torch_dtype") or ""))
    if want:
        # Unquantized tensors (embeddings, norms, ignored layers, scales aside) carry the config's dtype;
        # float32 beside a 16-bit dtype is tolerated (some checkpoints keep norms in full precision).
        allowed = {want, "F32"}
        for k, (s, v) in sorted(tensors.items()):
            if v["dtype"] in ("F16", "BF16", "F32") and not k.endswith(QUANT_PARAMS) and v["dtype"] not in allowed:
                problems.append(f"{s}: tensor {k} is {v['dtype']} but config.json says dtype {config.get('dtype') or config.get('torch_dtype')}")
                break
    return problems


def _read_json(path: Path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
