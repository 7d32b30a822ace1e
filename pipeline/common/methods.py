"""What each quantization method is, in one table: its compressed-tensors scheme, whether it needs calibration data, its
weight bits and the calibration state that pre-flight sizes. The quantize stage builds its modifiers from the artifact;
everything else that must know a method (pre-flight, recipe checks, reports) reads it here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Method:
    scheme: Callable  # artifact -> compressed-tensors preset name
    calibrated: Callable  # artifact -> needs calibration data
    weight_bits: Callable  # artifact -> bits per quantized weight
    hessians: bool = False  # GPTQ keeps an fp32 in_features x in_features Hessian per Linear of a layer
    activation_cache: bool = False  # AWQ caches the layer's activations in fp32


def _w_a16(a) -> str:
    return f"W{getattr(a, 'bits', 4)}A16" + ("" if getattr(a, "symmetric", True) else "_ASYM")


METHODS = {
    "awq": Method(scheme=_w_a16, calibrated=lambda a: True, weight_bits=lambda a: 4, activation_cache=True),
    "gptq": Method(
        scheme=lambda a: f"W{a.bits}A16", calibrated=lambda a: True, weight_bits=lambda a: a.bits, hessians=True
    ),
    "fp8": Method(
        scheme=lambda a: {"dynamic": "FP8_DYNAMIC", "static": "FP8", "block": "FP8_BLOCK"}[a.mode],
        calibrated=lambda a: a.mode == "static",
        weight_bits=lambda a: 8,
    ),
    "w8a8-int8": Method(scheme=lambda a: "W8A8", calibrated=lambda a: True, weight_bits=lambda a: 8, hessians=True),
    "rtn": Method(scheme=_w_a16, calibrated=lambda a: False, weight_bits=lambda a: a.bits),
}


def scheme_name(a) -> str:
    """The compressed-tensors preset an artifact uses (for metrics and reports)."""
    return METHODS[a.method].scheme(a)


def needs_calibration(a) -> bool:
    return METHODS[a.method].calibrated(a)


def weight_bits(a) -> int:
    return METHODS[a.method].weight_bits(a)


def group_size(a) -> int | None:
    """Columns per quantization group (None: per channel, or not weight-grouped)."""
    return getattr(a, "group_size", None)
