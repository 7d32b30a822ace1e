"""Quantize stage: the merged model -> one compressed-tensors artifact, with llm-compressor's `oneshot`. Each artifact
becomes a directory that vLLM loads as it is (it reads the `quantization_config` compressed-tensors writes into
config.json) and transformers decompresses on load. The llm-compressor recipe applied is saved twice: `recipe.yaml` as
llm-compressor writes it (it holds `!!python/tuple`, which `yaml.safe_load` cannot read) and `llmcompressor_recipe.json`,
plain JSON; `calibration.json` records which samples were used and their hash. rtn needs no data and is the reference
the calibrated methods must beat; `backend: autoawq` and `backend: gptqmodel` hand awq and gptq artifacts to the legacy
quantizers instead (legacy.py).

    from quantpipe.recipe import load
    from quantpipe.run.plan import stage_input
    from quantpipe.stages.quantize import run
    run(stage_input("quantize", load("recipes/demo-tiny.yaml"), "gptq", base_dir), Path(".tiny/llama-merged"), Path("/tmp/gptq"))
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from ...common.compute import compute_dtype
from ...common.methods import needs_calibration, scheme_name
from .. import StageError
from ..contract import QuantizeInput, Upstream
from .artifact import SHARD_SIZE, copy_side_files, output_metrics, seed_everything

log = logging.getLogger(__name__)

LEGACY_BACKENDS = {"autoawq", "gptqmodel"}


def _weight_only_groups(bits: int, symmetric: bool, targets: list[str], group_size: int | None) -> dict:
    """W4A16/W8A16 with the recipe's symmetry and group size (None: one scale per output channel)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    w = PRESET_SCHEMES[f"W{bits}A16"]["weights"].model_dump()
    w.update(symmetric=symmetric)
    w.update(strategy="group", group_size=group_size) if group_size else w.update(strategy="channel", group_size=None)
    return {"group_0": QuantizationScheme(targets=list(targets), weights=QuantizationArgs.model_validate(w))}


def build_modifiers(a) -> list:
    """The llm-compressor modifiers for an artifact, in the order they apply."""
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier

    common = {"targets": list(a.targets), "ignore": list(a.ignore)}
    if a.method == "awq":
        from llmcompressor.modifiers.transform import AWQModifier

        # mappings left unset: llm-compressor picks its registered ones for the architecture
        # (LlamaForCausalLM, Qwen2ForCausalLM... -> default_mappings) and logs when it falls back
        return [
            AWQModifier(duo_scaling=a.duo_scaling, n_grid=a.n_grid),
            QuantizationModifier(
                config_groups=_weight_only_groups(4, a.symmetric, a.targets, a.group_size), ignore=list(a.ignore)
            ),
        ]
    if a.method == "gptq":
        return [
            GPTQModifier(
                config_groups=_weight_only_groups(a.bits, True, a.targets, a.group_size),
                ignore=list(a.ignore),
                actorder=a.actorder,
                dampening_frac=a.dampening_frac,
                block_size=a.block_size,
            )
        ]
    if a.method == "rtn":
        return [
            QuantizationModifier(
                config_groups=_weight_only_groups(a.bits, a.symmetric, a.targets, a.group_size), ignore=list(a.ignore)
            )
        ]
    if a.method == "fp8":
        return [QuantizationModifier(scheme=scheme_name(a), **common)]
    if a.method == "w8a8-int8":
        from llmcompressor.modifiers.transform import SmoothQuantModifier

        return [
            SmoothQuantModifier(smoothing_strength=a.smoothing_strength),
            GPTQModifier(scheme="W8A8", dampening_frac=a.dampening_frac, **common),
        ]
    raise StageError(f"unknown quantization method {a.method!r}")


def oneshot_kwargs(a, inp: QuantizeInput, model, tokenizer, dataset) -> dict:
    """Everything handed to `oneshot` (the bench script calls it bare with exactly these)."""
    kw: dict[str, Any] = {"model": model, "recipe": build_modifiers(a), "tokenizer": tokenizer}
    if dataset is not None:
        c = inp.calibration
        # quantpipe.calibration already drew, shuffled (seeded) and truncated the samples: llm-compressor takes them all
        kw |= {
            "dataset": dataset,
            "num_calibration_samples": len(dataset),
            "max_seq_length": c.max_seq_len,
            "shuffle_calibration_samples": False,
            "batch_size": 1,
        }
    if a.pipeline is not None:
        kw["pipeline"] = a.pipeline
    if a.sequential_targets is not None:
        kw["sequential_targets"] = list(a.sequential_targets)
    return kw


@contextlib.contextmanager
def cpu_safe_awq():
    """Let AWQ run on a torch without an accelerator: llm-compressor 0.14's AWQModifier._apply_smoothing pins the cached
    activations (IntermediatesCache.pin_memory) for host-to-device copies, which on a CPU-only torch raises "Cannot access
    accelerator device when none is available"; there pinning, useless anyway, is a no-op for the duration of `oneshot`."""
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    if torch.accelerator.is_available():
        yield False
        return
    original = IntermediatesCache.__dict__["pin_memory"]
    IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None
    try:
        yield True
    finally:
        IntermediatesCache.pin_memory = original


@contextlib.contextmanager
def cpu_serial_layer_updates(method: str):
    """Run GPTQ's and AWQ's per-layer updates on one thread when torch has no accelerator. Both are many small tensor ops
    (llm-compressor 0.14's GPTQ quantizes every Linear column by column, 4992 columns per layer of SmolLM2-135M; AWQ
    re-runs the layer's parts per grid point), and on a CPU the synchronisation of torch's intra-op threads then costs
    more than the arithmetic: on 2 AVX-512 cores shared with another busy process, SmolLM2-135M's GPTQ solve (W4A16,
    group 64) took 309 s with 2 threads against 33 s with 1, AWQ (n_grid 5, 64 x 128 tokens) ~20 s per layer against
    ~5 s. The calibration passes keep every thread."""
    import torch

    if method not in ("gptq", "w8a8-int8", "awq") or torch.accelerator.is_available() or torch.get_num_threads() == 1:
        yield False
        return
    if method == "awq":
        from llmcompressor.modifiers.transform import AWQModifier as cls
    else:
        from llmcompressor.modifiers.gptq import GPTQModifier as cls
    original = cls.__dict__["on_sequential_epoch_end"]

    def on_sequential_epoch_end(self, *args, **kwargs):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.set_num_threads(threads)

    cls.on_sequential_epoch_end = on_sequential_epoch_end
    try:
        yield True
    finally:
        cls.on_sequential_epoch_end = original


def store_as(model, dtype: str) -> None:
    """Cast a model calibrated in float32 to `dtype`, as a calibration in `dtype` leaves it: every float32 parameter and
    buffer (weights and llm-compressor's scales), after removing llm-compressor's offloading so the cast reaches them all."""
    import torch
    from compressed_tensors.offload import remove_dispatch

    remove_dispatch(model)
    target = getattr(torch, dtype)
    for t in model.state_dict(keep_vars=True).values():  # the saved tensors; tied ones are one object, cast in place
        if t.dtype == torch.float32:
            t.data = t.data.to(target)
    model.config.dtype = target


def run(inp: QuantizeInput, src: Path, out: Path, upstream: dict[str, Upstream] | None = None) -> dict:
    """Quantize the model in `src` into `out` (compressed-tensors). Returns metrics for the run log."""
    a = inp.artifact
    if getattr(a, "backend", "llm-compressor") in LEGACY_BACKENDS:
        from .legacy import run as run_legacy  # AutoAWQ / GPTQModel, each in its own environment

        return run_legacy(inp, Path(src), Path(out))
    src, out = Path(src), Path(out)
    if not (src / "config.json").is_file():
        raise StageError(f"{src} is not a model directory (no config.json); the quantize stage reads the merged model")
    data = needs_calibration(a)
    if data and inp.calibration is None:
        raise StageError(
            f"artifact {a.name!r} ({a.method}) needs calibration data: add a `calibration:` section to the recipe"
        )

    t_import = time.perf_counter()
    import torch
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ... import calibration as cal

    t0 = time.perf_counter()

    seed = inp.calibration.seed if inp.calibration else 0
    seed_everything(seed)
    try:
        tokenizer = AutoTokenizer.from_pretrained(src, trust_remote_code=inp.base.trust_remote_code)
    except Exception as e:
        if data:
            raise StageError(
                f"{src}: cannot load its tokenizer ({type(e).__name__}: {e}); calibration needs the tokenizer saved with the model"
            ) from None
        tokenizer = None
    prepared = cal.prepare(inp.calibration, tokenizer) if data else None
    dataset = prepared.dataset() if prepared else None
    t_cal = time.perf_counter()
    work = compute_dtype(inp.base.dtype, "cpu" if not torch.accelerator.is_available() else "accelerator")
    model = AutoModelForCausalLM.from_pretrained(
        src,
        dtype=getattr(torch, work),
        trust_remote_code=inp.base.trust_remote_code,
        use_safetensors=None if inp.base.allow_pickle else True,
    )
    t_load = time.perf_counter()

    kwargs = oneshot_kwargs(a, inp, model, tokenizer, dataset)
    guard = cpu_safe_awq() if a.method == "awq" else contextlib.nullcontext(False)
    try:
        with guard as patched, cpu_serial_layer_updates(a.method) as serial:
            if patched:
                log.info("no accelerator: AWQ's activation pinning is skipped (llm-compressor 0.14 CPU workaround)")
            if serial:
                log.info("no accelerator: %s's per-layer updates run on one thread", a.method)
            oneshot(**kwargs)
    except ValueError as e:
        if "divisible" in str(e):
            raise StageError(
                f"artifact {a.name!r}: {e} Pick a group_size that divides these layers' input size, or add them to `ignore`."
            ) from None
        raise
    t_oneshot = time.perf_counter()
    if work != inp.base.dtype:
        store_as(model, inp.base.dtype)
    # 5 GB shards, as the merge stage writes (llm-compressor's default is 20 GB): the package stage then
    # hard-links them instead of re-sharding an 8B model's single 9 GB file at its default 5GB.
    model.save_pretrained(out, save_compressed=True, max_shard_size=SHARD_SIZE)
    copy_side_files(src, out)
    t_save = time.perf_counter()

    from llmcompressor.core import active_session

    modifiers = active_session().lifecycle.recipe.to_dict()
    (out / "llmcompressor_recipe.json").write_text(json.dumps(modifiers, indent=2, default=str) + "\n")
    provenance = (
        prepared.provenance(inp.calibration)
        if prepared
        else {
            "calibration_sha256": None,
            "n_samples": 0,
            "n_tokens": 0,
            "truncated_samples": 0,
            "note": f"{scheme_name(a)} needs no calibration data",
        }
    )
    (out / "calibration.json").write_text(json.dumps(provenance, indent=2) + "\n")

    return {
        **output_metrics(a, src, out, provenance),
        "import_s": round(t0 - t_import, 3),
        "calibration_s": round(t_cal - t0, 3),
        "load_s": round(t_load - t_cal, 3),
        "oneshot_s": round(t_oneshot - t_load, 3),
        "save_s": round(t_save - t_oneshot, 3),
        "seed": seed,
        "compute_dtype": work,
        "accelerator": str(torch.accelerator.current_accelerator()) if torch.accelerator.is_available() else None,
    }
