"""Legacy quantizers: `backend: autoawq` (AutoAWQ's AWQ-GEMM checkpoint) and `backend: gptqmodel` (GPTQ), for users who
need the formats those tools write (`quant_method: awq` or `gptq` in config.json; vLLM serves both, transformers 5 reads
both through gptqmodel). llm-compressor is the default for every method: AutoAWQ was adopted into it and is
unmaintained, and AutoGPTQ's successor is GPTQModel. Each backend runs in an environment of its own, built on demand and
picked by the runner (envs.stage_env). The calibration samples are exactly the default path's (quantpipe.calibration),
`backend.json` records the library versions and the quantizer's arguments, and options a backend cannot honour are
refused by the recipe schema (recipe._legacy_options), not ignored.

    scripts/setup_envs.sh legacy     # .venv/autoawq (transformers 4) and .venv/gptqmodel
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from .. import StageError
from ..contract import QuantizeInput
from .artifact import copy_side_files, output_metrics, seed_everything

log = logging.getLogger(__name__)

MODULE = {"autoawq": "awq", "gptqmodel": "gptqmodel"}
# actorder as llm-compressor names it -> GPTQModel's (desc_act, static_groups): "weight" (alias
# "static") reorders columns but keeps groups in the original order, as static_groups does.
ACTORDER = {None: (False, False), "group": (True, False), "weight": (True, True), "static": (True, True)}


def run(inp: QuantizeInput, src: Path, out: Path) -> dict:
    """Quantize the model in `src` into `out` with the artifact's legacy backend. Returns metrics for the run log."""
    a = inp.artifact
    backend = a.backend
    if importlib.util.find_spec(MODULE[backend]) is None:
        raise StageError(
            f"artifact {a.name!r}: backend {backend} runs in the {backend} environment, and this interpreter "
            f"({sys.prefix}) does not have it; build it with `scripts/setup_envs.sh legacy` and let `quantpipe run` pick it"
        )
    if not (src / "config.json").is_file():
        raise StageError(f"{src} is not a model directory (no config.json); the quantize stage reads the merged model")
    if inp.calibration is None:
        raise StageError(
            f"artifact {a.name!r} ({a.method}) needs calibration data: add a `calibration:` section to the recipe"
        )
    seed_everything(inp.calibration.seed)
    with tempfile.TemporaryDirectory(prefix="quantpipe-legacy-") as work:
        quantize = _autoawq if backend == "autoawq" else _gptqmodel
        prepared, args, times, extra = quantize(inp, a, src, out, Path(work))
    copy_side_files(src, out)  # the source's tokenizer, chat template and generation config, verbatim

    provenance = prepared.provenance(inp.calibration)
    (out / "calibration.json").write_text(json.dumps(provenance, indent=2) + "\n")
    libs = {n: importlib.metadata.version(n) for n in (backend, "transformers", "torch")}
    (out / "backend.json").write_text(
        json.dumps({"backend": backend, "versions": libs, "arguments": args}, indent=2, default=str) + "\n"
    )

    import torch

    return {
        **output_metrics(a, src, out, provenance),
        "backend": backend,
        **times,
        **extra,
        "seed": inp.calibration.seed,
        "versions": libs,
        "accelerator": str(torch.accelerator.current_accelerator()) if torch.accelerator.is_available() else None,
    }


# --- AutoAWQ ------------------------------------------------------------------------------------


def transformers4_view(src: Path, work: Path) -> Path:
    """`src` as transformers 4 reads it: every file linked, config.json with `rope_theta` (4.x ignores transformers 5's
    `rope_parameters` and would quantize with its default theta, 10000, a different model, without a word)."""
    cfg = json.loads((src / "config.json").read_text())
    rope = cfg.pop("rope_parameters", None)
    if rope is not None:
        if "rope_theta" not in rope:
            raise StageError(
                f"{src}/config.json: rope_parameters {rope} (per layer type) cannot be given to transformers 4; use backend: llm-compressor"
            )
        cfg.setdefault("rope_theta", rope["rope_theta"])
        if rope.get("rope_type", "default") != "default":
            cfg.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
    if "dtype" in cfg:  # transformers 5's name for torch_dtype
        cfg.setdefault("torch_dtype", cfg.pop("dtype"))
    view = work / "model"
    view.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (view / f.name).symlink_to(f.resolve())
    (view / "config.json").write_text(json.dumps(cfg, indent=2))
    return view


def _autoawq(inp: QuantizeInput, a, src: Path, out: Path, work: Path):
    t0 = time.perf_counter()
    import torch
    from awq import AutoAWQForCausalLM
    from transformers import AutoTokenizer

    from ... import calibration as cal

    t1 = time.perf_counter()
    c = inp.calibration
    model_dir = transformers4_view(src, work)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=inp.base.trust_remote_code)
    prepared = cal.prepare(c, tokenizer)
    # AutoAWQ concatenates the samples and cuts them into blocks of max_calib_seq_len tokens, dropping
    # the remainder (samples longer than a block would be dropped whole: calibration already truncated them)
    blocks = prepared.n_tokens // c.max_seq_len
    if blocks == 0:
        raise StageError(
            f"artifact {a.name!r}: AutoAWQ calibrates on blocks of max_seq_len={c.max_seq_len} tokens cut from the "
            f"concatenated samples, and these hold only {prepared.n_tokens} tokens; add samples or lower calibration.max_seq_len"
        )
    t2 = time.perf_counter()
    # float16: AutoAWQ's GEMM format stores float16 scales, and vLLM serves AWQ in float16
    model = AutoAWQForCausalLM.from_pretrained(
        str(model_dir),
        torch_dtype=torch.float16,
        trust_remote_code=inp.base.trust_remote_code,
        safetensors=not inp.base.allow_pickle,
    )
    t3 = time.perf_counter()
    skip = [m for m in a.ignore if m != "lm_head"]  # AutoAWQ never quantizes lm_head
    quant_config = {
        "zero_point": True,
        "q_group_size": a.group_size,
        "w_bit": 4,
        "version": "GEMM",
        "modules_to_not_convert": skip or None,
    }
    kwargs = {
        "duo_scaling": a.duo_scaling,
        "max_calib_samples": len(prepared.input_ids),
        "max_calib_seq_len": c.max_seq_len,
    }
    model.quantize(tokenizer, quant_config=quant_config, calib_data=prepared.input_ids, **kwargs)
    model.model.config.use_cache = json.loads((src / "config.json").read_text()).get(
        "use_cache", True
    )  # AutoAWQ loads with it off
    t4 = time.perf_counter()
    model.save_quantized(str(out))
    t5 = time.perf_counter()
    times = {
        "import_s": round(t1 - t0, 3),
        "calibration_s": round(t2 - t1, 3),
        "load_s": round(t3 - t2, 3),
        "quantize_s": round(t4 - t3, 3),
        "save_s": round(t5 - t4, 3),
    }
    extra = {"format": "awq-gemm", "calibration_blocks": blocks, "calibration_tokens_used": blocks * c.max_seq_len}
    return prepared, {"quant_config": quant_config, "quantize": kwargs, "dtype": "float16"}, times, extra


# --- GPTQModel ----------------------------------------------------------------------------------


def _gptqmodel(inp: QuantizeInput, a, src: Path, out: Path, work: Path):
    # GPTQModel sizes its CPU thread pool from this at import; more workers than cores only contend
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(min(2, os.cpu_count() or 1)))
    t0 = time.perf_counter()
    import torch
    from gptqmodel import GPTQModel, QuantizeConfig
    from transformers import AutoTokenizer

    from ... import calibration as cal

    t1 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(src, trust_remote_code=inp.base.trust_remote_code)
    prepared = cal.prepare(inp.calibration, tokenizer)
    t2 = time.perf_counter()
    desc_act, static_groups = ACTORDER[a.actorder]
    skip = [m for m in a.ignore if m != "lm_head"]
    config = {
        "bits": a.bits,
        "group_size": a.group_size or -1,
        "sym": True,
        "desc_act": desc_act,
        "static_groups": static_groups,
        "act_group_aware": False,
        "damp_percent": a.dampening_frac,
        "lm_head": False,
        # in memory, as llm-compressor does: its disk offload also writes a temporary path into config.json
        "offload_to_disk": False,
        # a negative `dynamic` rule skips the modules it matches
        "dynamic": {f"-:{m[3:] if m.startswith('re:') else re.escape(m)}": {} for m in skip} or None,
    }
    model = GPTQModel.load(
        str(src),
        QuantizeConfig(**config),
        trust_remote_code=inp.base.trust_remote_code,
        dtype=getattr(torch, inp.base.dtype),
    )
    t3 = time.perf_counter()
    samples = [{"input_ids": ids, "attention_mask": [1] * len(ids)} for ids in prepared.input_ids]
    # every sample as calibration prepared it: none dropped for being short, none re-ordered
    kwargs = {"batch_size": 1, "calibration_data_min_length": 0, "calibration_sort": None}
    model.quantize(samples, tokenizer=tokenizer, **kwargs)
    t4 = time.perf_counter()
    model.save(str(out))
    t5 = time.perf_counter()
    times = {
        "import_s": round(t1 - t0, 3),
        "calibration_s": round(t2 - t1, 3),
        "load_s": round(t3 - t2, 3),
        "quantize_s": round(t4 - t3, 3),
        "save_s": round(t5 - t4, 3),
    }
    return prepared, {"quantize_config": config, "quantize": kwargs, "dtype": inp.base.dtype}, times, {"format": "gptq"}
