"""The quantization methods a recipe's `artifacts` may use: one pydantic model per method, discriminated on `method`.
Each holds only what its method takes, with llm-compressor's usual defaults; options a legacy backend (autoawq,
gptqmodel) cannot honour are refused rather than ignored. What needs the model's config.json (a group size that does
not divide a layer's width) is checked in `quantpipe.fit`:

    from quantpipe.recipe import GPTQ
    GPTQ(name="gptq", method="gptq", group_size=64)
"""

from __future__ import annotations

import re
import typing
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Artifact(Strict):
    name: str = Field(description="Short name: lowercase letters, digits, '-', '_' or '.'; used in paths.")
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"], description="Modules left unquantized.")
    targets: list[str] = Field(default_factory=lambda: ["Linear"])
    sequential_targets: list[str] | None = Field(None, description="Decoder-layer class names onloaded one at a time.")
    pipeline: Literal["independent", "sequential", "basic", "datafree"] | None = Field(
        None, description="llm-compressor calibration pipeline; default: its own choice."
    )

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        if not NAME.match(v):
            raise ValueError(
                f"artifact name {v!r} must be 1-64 of a-z, 0-9, '-', '_', '.', starting with a letter or digit "
                "(it becomes a directory name)"
            )
        return v

    @field_validator("ignore", "targets")
    @classmethod
    def _patterns_compile(cls, v: list[str]) -> list[str]:
        # compressed-tensors matches "re:<pattern>" with re.match on each module name: a broken pattern fails inside oneshot
        for p in v:
            if p.startswith("re:"):
                try:
                    re.compile(p[3:])
                except re.error as e:
                    raise ValueError(
                        f"{p!r} is not a valid regular expression ({e}); fix the pattern after `re:`"
                    ) from None
        return v


def _legacy_options(a: _Artifact, backend: str) -> None:
    """Options of the llm-compressor path that a legacy backend cannot honour are refused, not ignored."""
    if list(a.targets) != ["Linear"]:
        raise ValueError(
            f"backend {backend} quantizes the Linear layers of the decoder blocks only: remove `targets` or use backend: llm-compressor"
        )
    if "lm_head" not in a.ignore:
        raise ValueError(
            f"backend {backend} cannot quantize lm_head: keep lm_head in `ignore` or use backend: llm-compressor"
        )
    if any(i.startswith("re:") for i in a.ignore) and backend == "autoawq":
        raise ValueError(
            "backend autoawq skips modules by name (substring), not by `re:` pattern: list the names in `ignore`"
        )
    for key in ("pipeline", "sequential_targets"):
        if getattr(a, key) is not None:
            raise ValueError(
                f"`{key}` is an llm-compressor option; backend {backend} has none: remove it or use backend: llm-compressor"
            )


class AWQ(_Artifact):
    method: Literal["awq"]
    symmetric: bool = Field(False, description="W4A16 (symmetric) or W4A16_ASYM (asymmetric, AWQ's usual choice).")
    group_size: Literal[32, 64, 128, 256] = 128
    duo_scaling: bool = True
    n_grid: int = Field(20, ge=1, le=100, description="Grid points searched per smoothing scale.")
    backend: Literal["llm-compressor", "autoawq"] = Field(
        "llm-compressor",
        description="autoawq: legacy AutoAWQ GEMM checkpoint, in its own environment (`make setup-legacy`).",
    )

    @model_validator(mode="after")
    def _autoawq_options(self):
        if self.backend == "autoawq":
            _legacy_options(self, "autoawq")
            if self.symmetric:
                raise ValueError(
                    "backend autoawq writes the GEMM format, which needs zero points: remove `symmetric: true` or use backend: llm-compressor"
                )
            if self.n_grid != 20:
                raise ValueError(
                    f"backend autoawq searches a fixed grid of 20 points: remove `n_grid: {self.n_grid}` or use backend: llm-compressor"
                )
        return self


class GPTQ(_Artifact):
    method: Literal["gptq"]
    bits: Literal[4, 8] = 4
    group_size: Literal[32, 64, 128, 256] | None = 128
    actorder: Literal["static", "group", "weight"] | None = "static"
    dampening_frac: float = Field(0.01, gt=0, lt=1)
    block_size: int = Field(128, ge=1)
    backend: Literal["llm-compressor", "gptqmodel", "auto-gptq"] = Field(
        "llm-compressor",
        description="gptqmodel: GPTQModel's GPTQ checkpoint, in its own environment (`make setup-legacy`).",
    )

    @field_validator("backend")
    @classmethod
    def _no_auto_gptq(cls, v: str) -> str:
        if v == "auto-gptq":
            raise ValueError(
                "auto-gptq is unmaintained and cannot import under transformers 5 (no_init_weights); "
                "use backend: llm-compressor (default) or backend: gptqmodel, its successor"
            )
        return v

    @model_validator(mode="after")
    def _gptqmodel_options(self):
        if self.backend == "llm-compressor" and self.actorder == "group":
            # llm-compressor 0.14 reorders by weight only (apply_activation_ordering raises inside oneshot)
            raise ValueError(
                "actorder group is not supported by llm-compressor's GPTQ (it takes static, i.e. weight, or none): "
                "use actorder: static, or backend: gptqmodel, which still has it"
            )
        if self.backend == "gptqmodel":
            _legacy_options(self, "gptqmodel")
            if self.block_size != 128:
                raise ValueError(
                    f"backend gptqmodel works in fixed blocks of 128 columns: remove `block_size: {self.block_size}` or use backend: llm-compressor"
                )
        return self


class FP8(_Artifact):
    method: Literal["fp8"]
    mode: Literal["dynamic", "static", "block"] = Field(
        "dynamic",
        description="dynamic: FP8_DYNAMIC (no calibration); static: calibrated per-tensor activations; block: FP8_BLOCK.",
    )


class W8A8Int8(_Artifact):
    method: Literal["w8a8-int8"]
    smoothing_strength: float = Field(0.8, ge=0, le=1)
    dampening_frac: float = Field(0.01, gt=0, lt=1)


class RTN(_Artifact):
    """Round-to-nearest weight-only quantization: the uncalibrated reference the others must beat."""

    method: Literal["rtn"]
    bits: Literal[4, 8] = 4
    group_size: Literal[32, 64, 128, 256] = 128
    symmetric: bool = Field(
        True,
        description="Symmetric (W4A16) or with zero points (W4A16_ASYM: the like-for-like reference for AWQ's default).",
    )


Artifact = Annotated[Union[AWQ, GPTQ, FP8, W8A8Int8, RTN], Field(discriminator="method")]
METHODS = ("awq", "gptq", "fp8", "w8a8-int8", "rtn")
GROUPED = {
    "awq": AWQ,
    "gptq": GPTQ,
    "rtn": RTN,
}  # the methods that quantize weights in groups along the input dimension


def group_sizes(method: str) -> tuple[int, ...]:
    """The group sizes the schema accepts for a grouped method (read from its `group_size` annotation)."""

    def ints(ann) -> list[int]:
        if typing.get_origin(ann) is Literal:
            return [a for a in typing.get_args(ann) if isinstance(a, int)]
        return [x for arm in typing.get_args(ann) for x in ints(arm)]  # Literal[...] | None

    return tuple(sorted(ints(GROUPED[method].model_fields["group_size"].annotation)))
