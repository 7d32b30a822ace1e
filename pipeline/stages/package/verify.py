"""A package's manifest: building it, and checking a package against it (`quantpipe verify DIR`)."""

from __future__ import annotations

import json
from pathlib import Path

from ...common.safetensors import read_header
from ..contract import PackageInput, Upstream

MANIFEST = "manifest.json"
INDEX = "model.safetensors.index.json"
# Tensor-name suffixes of compressed-tensors' quantization parameters (not model weights proper).
QUANT_PARAMS = (
    "weight_scale",
    "weight_zero_point",
    "weight_global_scale",
    "weight_g_idx",
    "weight_shape",
    "weight_packed",
    "input_scale",
    "input_zero_point",
    "input_global_scale",
    "output_scale",
    "k_scale",
    "v_scale",
)
SAFETENSORS_DTYPES = {
    "BOOL",
    "U8",
    "I8",
    "F8_E5M2",
    "F8_E4M3",
    "F8_E8M0",
    "F4",
    "I16",
    "U16",
    "F16",
    "BF16",
    "I32",
    "U32",
    "F32",
    "F64",
    "I64",
    "U64",
    "C64",
}
TORCH_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "half": "F16", "float": "F32"}


def build_manifest(
    inp: PackageInput, out: Path, src: Path, stages: dict, own: Upstream | None, weights: dict, ctx: dict
) -> dict:
    from ...cache import file_sha256, recorded_hashes

    known = recorded_hashes([src])  # the shards hard-linked from the quantize entry: hashed at its commit
    files = {}
    for p in sorted(out.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            files[str(p.relative_to(out))] = {"size": p.stat().st_size, "sha256": file_sha256(p, known)}
    recs = [rec for rec in stages.values() if rec is not None]
    keys = {rec.stage: rec.key for rec in recs} | ({own.stage: own.key} if own else {})
    timings = {rec.stage: rec.wall_s or rec.metrics.get("wall_s") for rec in recs}
    return {
        "format": "quantpipe-package/1",
        "artifact": inp.artifact.name,
        "name": ctx["name"],
        "files": files,
        "weights": {
            "shards": weights["files"],
            "resharded": weights["resharded"],
            "max_shard_size": inp.package.max_shard_size,
        },
        "recipe": inp.model_dump(mode="json"),
        "recipe_hash": ctx["provenance"]["recipe_hash"],
        "stage_keys": keys,
        "timings_s": timings,
        "quantpipe": {"git_commit": ctx["provenance"]["quantpipe_commit"]},
        "versions": ctx["provenance"]["versions"],
        "hardware": ctx["provenance"]["hardware"],
        "trust_remote_code": inp.base.trust_remote_code,
        "allow_pickle": inp.base.allow_pickle,
        "license": ctx.get("license"),
        "serve_command": ctx["serve"]["command"],
    }


def verify_package(dir: Path) -> list[str]:
    """Problems with a package (each naming the file); [] when every file matches manifest.json and the config, index and
    safetensors headers agree."""
    root = Path(dir)
    if not root.is_dir():
        return [f"{root}: not a directory"]
    manifest = _read_json(root / MANIFEST)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return [f"{MANIFEST}: missing or unreadable; this is not a quantpipe package (or the manifest was damaged)"]
    from ...cache import sha256_file

    problems = []
    recorded = manifest["files"]
    present = {
        str(p.relative_to(root)) for p in root.rglob("*") if (p.is_file() or p.is_symlink()) and p.name != MANIFEST
    }
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
            if (
                not isinstance(v, dict)
                or v.get("dtype") not in SAFETENSORS_DTYPES
                or len(v.get("data_offsets") or []) != 2
            ):
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
        expected = {
            "pack-quantized": ("weight_packed", {"I32"}),
            "float-quantized": ("weight", {"F8_E4M3"}),
            "int-quantized": ("weight", {"I8"}),
            "naive-quantized": ("weight", {"I8", "F8_E4M3"}),
        }.get(fmt_)
        if expected:
            suffix, dtypes = expected
            quantized = [k for k, (s, v) in tensors.items() if k.endswith("." + suffix) and v["dtype"] in dtypes]
            if not quantized:
                problems.append(
                    f"config.json: quantization format {fmt_!r} but no {'/'.join(sorted(dtypes))} `{suffix}` tensor in the shards"
                )
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
                problems.append(
                    f"{s}: tensor {k} is {v['dtype']} but config.json says dtype {config.get('dtype') or config.get('torch_dtype')}"
                )
                break
    return problems


def _read_json(path: Path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
