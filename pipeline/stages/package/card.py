"""The model card of a package: what was done, accuracy against the baseline, benchmark tables, the serve command."""

from __future__ import annotations

import shlex
from pathlib import Path

from ...common.fmt import fidelity_text, fmt, human_bytes, md_cell, md_code, md_fence
from ...common.gates import check_gates
from ..contract import PackageInput

TEMPLATES = Path(__file__).resolve().parent.parent.parent / "templates"


def serve_command(inp, artifact: str, bench: dict) -> dict:
    """The `vllm serve` line with the engine arguments of the variant the benchmark found best: the effective
    arguments it served with (benchmark metrics `variants`), else the recipe's engine with that variant laid over it."""
    from ...common.vllm_support import engine_flags, variant_engines

    best = bench.get("best") if isinstance(bench.get("best"), dict) else {}
    variant = best.get("variant")
    measured = (
        (bench.get("variants") or {}).get(variant or "default") if isinstance(bench.get("variants"), dict) else None
    )
    if isinstance(measured, dict) and isinstance(measured.get("engine"), dict) and measured["engine"]:
        engine, source = dict(measured["engine"]), "measured"
    else:
        engine, source = (
            dict(variant_engines(inp)).get(variant or "default", inp.benchmark.engine).model_dump(),
            "recipe",
        )
        if inp.base.trust_remote_code:
            engine["trust_remote_code"] = True
    args = engine_flags({k: v for k, v in engine.items() if k != "lora_flags" and v != []})
    return {
        "variant": variant,
        "concurrency": best.get("concurrency"),
        "reason": best.get("reason"),
        "engine": engine,
        "source": source,
        "measured": bool(bench),
        "command": shlex.join(["vllm", "serve", f"./{artifact}", *args]),
    }


def card_context(inp: PackageInput, config: dict, stages: dict, weights: dict) -> dict:
    """Everything the model card shows, from the package's input and the measured metrics (missing ones stay None)."""
    from ...cache import hash_json
    from ...envs import git_commit, hardware, versions

    art, artifact = inp.artifact, inp.artifact.name
    q, ev, bev, bench, bbench = (
        (stages[r].metrics if stages[r] else {})
        for r in ("quantize", "evaluation", "baseline_eval", "benchmark", "baseline_benchmark")
    )
    cal = inp.calibration
    base = inp.base.model
    base_ref = base if not inp.base.is_local else Path(base).name
    qc = config.get("quantization_config") or {}

    def key(r):
        return tuple(str(r.get(k)) for k in ("variant", "workload", "concurrency"))

    base_rows = {key(r): r for r in bbench.get("results") or [] if isinstance(r, dict)}
    bench_rows = []
    for r in [r for r in bench.get("results") or [] if isinstance(r, dict)]:
        b = base_rows.get(key(r))
        speedup = None
        if (
            b
            and isinstance(b.get("output_throughput"), (int, float))
            and isinstance(r.get("output_throughput"), (int, float))
            and b["output_throughput"]
        ):
            speedup = r["output_throughput"] / b["output_throughput"]
        bench_rows.append({**r, "speedup": speedup})
    gates = _gates(inp.gates, ev)
    return {
        "name": f"{inp.name}-{artifact}",
        "notes": inp.notes,
        "artifact": artifact,
        "method": art.method,
        "scheme": q.get("scheme"),
        "settings": {k: v for k, v in art.model_dump(mode="json", exclude={"name", "method"}).items() if v is not None},
        "format": qc.get("format"),
        "quant_method": qc.get("quant_method"),
        "base_model": base,
        "base_ref": base_ref,
        "base_is_local": inp.base.is_local,
        "revision": inp.base.revision,
        "adapters": [{"name": Path(a.path).name, "weight": a.weight} for a in inp.adapters],
        "calibration": {
            "sources": [
                {"ref": s.dataset or Path(s.path).name, "split": s.split if s.dataset else None, "weight": s.weight}
                for s in cal.sources
            ]
            if cal
            else [],
            "num_samples": cal.num_samples if cal else None,
            "max_seq_len": cal.max_seq_len if cal else None,
            "seed": cal.seed if cal else None,
            "sha256": q.get("calibration_sha256"),
            "n_samples": q.get("n_calibration_samples"),
        },
        "size_bytes": q.get("size_bytes"),
        "baseline_size_bytes": q.get("baseline_size_bytes"),
        "compression": q.get("compression"),
        "weights": weights,
        "max_shard_size": inp.package.max_shard_size,
        "eval": {
            "comparison": ev.get("comparison") or [],
            "validation": ev.get("validation"),
            "baseline_validation": bev.get("validation"),
            "fidelity": ev.get("fidelity"),
            "fidelity_text": fidelity_text(ev["fidelity"]) if ev.get("fidelity") else None,
            "settings": ev.get("settings") or {},
        },
        "gates": gates,
        "bench": {
            "servable": bench.get("servable"),
            "reason": bench.get("reason"),
            "status_note": bench.get("status_note"),
            "platform": bench.get("platform"),
            "rows": bench_rows,
            "offline": bench.get("offline"),
            "baseline_offline": bbench.get("offline"),
            "memory": bench.get("memory"),
            "best": bench.get("best"),
            "measured": bool(bench),
        },
        "serve": serve_command(inp, artifact, bench),
        "slo": inp.benchmark.slo.model_dump(),
        "provenance": {
            "quantpipe_commit": git_commit(),
            "hardware": hardware(),
            "versions": {e: versions(e) for e in ("quantize", "serve")},
            "recipe_hash": hash_json(inp.model_dump(mode="json"))[:16],
            "recipe_name": inp.name,
        },
        "trust_remote_code": inp.base.trust_remote_code,
    }


def _gates(g, ev: dict) -> dict | None:
    """The recipe's release gates applied to this artifact's evaluation (None when not evaluated)."""
    if not ev:
        return None
    failures = check_gates(g, ev)
    return {
        "status": "FAIL" if failures else "PASS",
        "failures": failures,
        "thresholds": {k: v for k, v in g.model_dump().items() if v not in (None, {})},
    }


def license_of(inp) -> tuple[str | None, str]:
    """(license, where it came from): the recipe's package.license, else the base model card's front matter."""
    if inp.package.license:
        return inp.package.license, "recipe"
    readme = Path(inp.base.model) / "README.md"
    if inp.base.is_local and readme.is_file():
        try:
            from huggingface_hub import ModelCard

            lic = ModelCard.load(readme, ignore_metadata_errors=True).data.to_dict().get("license")
            if lic:
                return str(lic), "base model card"
        except Exception:  # a malformed base card must not stop packaging; the license is then unknown
            pass
    return None, "unknown"


def write_card(inp: PackageInput, ctx: dict, path: Path, license_: str | None) -> None:
    from huggingface_hub import ModelCard, ModelCardData

    datasets = [s.dataset for s in inp.calibration.sources if s.dataset] if inp.calibration else []
    tags = ["quantpipe", "quantized", ctx["method"], "compressed-tensors", "llmcompressor", "vllm"]
    if ctx.get("scheme"):
        tags.append(str(ctx["scheme"]).lower())
    data = ModelCardData(
        base_model=ctx["base_ref"],
        base_model_relation="quantized",
        library_name="transformers",
        license=license_,
        datasets=datasets or None,
        tags=list(dict.fromkeys(t for t in tags if t)),
        model_name=ctx["name"],
    )
    card = ModelCard.from_template(
        data,
        template_str=_template("model_card.md.j2"),
        **ctx,
        fmt=fmt,
        human_bytes=human_bytes,
        md=md_cell,
        code=md_code,
        fence=md_fence,
    )
    path.write_text(str(card).rstrip() + "\n")


def _template(name: str) -> str:
    return (TEMPLATES / name).read_text()
