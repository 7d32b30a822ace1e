"""The recipe's `benchmark` section: the vLLM engine arguments and their variants, the workloads sent, the SLO and the
sweep (concurrency, precision, goodput search). Strict like the rest of the schema (`schema.py`) and checked from the
recipe alone: a `vllm serve` flag that quantpipe sets or that an engine field holds is refused, a workload's lengths
must fit its kind, and variant and workload names are unique because results are keyed by them:

    from quantpipe.recipe import Benchmark
    Benchmark.model_validate({"workloads": [{"name": "chat", "input_len": 512}], "concurrency": [1, 8]})
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from .methods import Strict


def _repeated(names) -> list[str]:
    names = list(names)
    return sorted({n for n in names if names.count(n) > 1})


class Engine(Strict):
    max_model_len: int | None = Field(None, ge=16)
    max_num_seqs: int | None = Field(None, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=16)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    enable_prefix_caching: bool | None = None
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] | None = None
    tensor_parallel_size: int | None = Field(None, ge=1)
    enforce_eager: bool | None = None
    kv_cache_memory_bytes: int | None = Field(
        None,
        ge=1 << 20,
        description=(
            "KV-cache size (vLLM's CPU backend needs one; quantpipe picks it when unset). On a GPU it replaces vLLM's sizing "
            "from the free memory at start-up, which lets the scheduler share the GPU outside the measured runs."
        ),
    )
    extra_args: list[str] = Field(default_factory=list, description="Further `vllm serve` flags, passed as given.")

    @field_validator("extra_args")
    @classmethod
    def _no_quantization_flag(cls, v: list[str]) -> list[str]:
        fields = {f.replace("_", "-"): f for f in cls.model_fields if f != "extra_args"}
        for a in v:
            if a.split("=")[0] in ("--quantization", "-q", "--host"):
                raise ValueError(f"{a.split('=')[0]} is set by quantpipe (vLLM detects quantization from the artifact)")
            # vLLM's parser reads --max_model_len as --max-model-len, and the last of two flags wins: one place for each
            flag = a.split("=")[0].replace("_", "-")
            name = flag.removeprefix("--no-") if flag.startswith("--no-") else flag.removeprefix("--")
            if flag.startswith("--") and name in fields:
                raise ValueError(
                    f"{a.split('=')[0]} is an engine field: set `{fields[name]}` in the engine instead "
                    "(quantpipe reads it to check workloads and estimate memory)"
                )
        return v


class Variant(Strict):
    name: str
    engine: Engine


class Workload(Strict):
    name: str
    kind: Literal["fixed", "validation", "shared_prefix"] = "fixed"
    input_len: int = Field(128, ge=1)
    output_len: int = Field(64, ge=1)
    prefix_len: int = Field(0, ge=0, description="shared_prefix: tokens of common system prompt.")
    num_prompts: int = Field(32, ge=1, le=100_000)

    @model_validator(mode="after")
    def _lengths_fit_the_kind(self):
        if self.kind == "shared_prefix" and self.prefix_len == 0:
            raise ValueError(
                "kind shared_prefix needs prefix_len (the shared system prompt's tokens, at least 1); set it, or use kind fixed"
            )
        if self.kind != "shared_prefix" and self.prefix_len:
            raise ValueError(
                f"prefix_len applies to kind shared_prefix only; remove it, or set kind: shared_prefix (this one is {self.kind})"
            )
        # compared with the default, not with the fields set, so that a dumped recipe validates again as it was
        if self.kind == "validation" and self.input_len != type(self).model_fields["input_len"].default:
            raise ValueError(
                "input_len does not apply to kind validation (its prompts are the validation set's); remove it"
            )
        return self

    @property
    def max_tokens(self) -> int | None:
        """The longest sequence (prompt + output) it sends; None for kind validation (the prompts' own lengths)."""
        if self.kind == "validation":
            return None
        return self.prefix_len + self.input_len + self.output_len


class SLO(Strict):
    ttft_p99_ms: float | None = Field(None, gt=0)
    tpot_p99_ms: float | None = Field(None, gt=0)
    e2el_p99_ms: float | None = Field(None, gt=0)


class Benchmark(Strict):
    enabled: bool = True
    engine: Engine = Engine()
    variants: list[Variant] = Field(
        default_factory=list, description="Engine-argument variants measured beside `engine`."
    )
    workloads: list[Workload] = Field(default_factory=lambda: [Workload(name="fixed")])
    concurrency: list[int] = Field(default_factory=lambda: [1, 4, 16])
    slo: SLO = SLO()
    offline: bool = Field(True, description="Also measure offline batch-1 latency and throughput.")
    lora: bool = Field(True, description="With adapters: also serve base + adapter at request time.")
    precision: float | None = Field(
        None,
        gt=0,
        lt=1,
        description=(
            "Target 95% half-width of each point's median TPOT, median e2e latency and output throughput (0.03 = ±3 %). "
            "A point whose run of `num_prompts` requests is wider runs again with as many requests as its spread asks, "
            "up to `max_prompts`. Unset: `num_prompts` requests per point."
        ),
    )
    max_prompts: int = Field(512, ge=1, le=100_000, description="With `precision`: the most requests one point runs.")
    goodput_search: int | None = Field(
        None,
        ge=1,
        le=4096,
        description=(
            "Also search, on the first workload, for the highest concurrency up to this at which the SLO holds (bisection "
            "from the sweep's points, to within 10 %): the artifact's goodput at the SLO is then the search's. Needs `slo`."
        ),
    )
    server_starts: int = Field(
        1,
        ge=1,
        le=10,
        description=(
            "Measure `engine` this many times, each from a fresh server: a point's figures are then the median over the "
            "starts and its 95% intervals span every start's, so they hold the spread between server starts, which one "
            "server's requests do not show. The goodput search, offline benches and memory come from the first start."
        ),
    )
    seed: int = 0

    @field_validator("concurrency")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if not v or any(c < 1 for c in v):
            raise ValueError("concurrency must be a non-empty list of positive integers, e.g. [1, 4, 16]")
        return sorted(set(v))

    @model_validator(mode="after")
    def _unique_names(self):
        if self.goodput_search and all(v is None for v in self.slo.model_dump().values()):
            raise ValueError(
                "goodput_search looks for the highest load within the SLO, and slo sets no bound: set slo "
                "(e.g. ttft_p99_ms: 500, tpot_p99_ms: 50) or remove goodput_search"
            )
        # results are keyed by variant and workload name (runs/, report, compare)
        dup = _repeated(w.name for w in self.workloads)
        if dup:
            raise ValueError(f"workload names must be unique; repeated: {', '.join(dup)}")
        dup = _repeated(["default", *self.start_names()] + [v.name for v in self.variants])
        if dup:
            raise ValueError(
                "variant names must be unique and not 'default' (the name of `engine` itself) nor default-start<k> (its "
                f"further server starts); repeated: {', '.join(dup)}"
            )
        return self

    def start_names(self) -> list[str]:
        """The variant names of `engine`'s further server starts (`server_starts`), each with its own logs and raw results."""
        return start_names(self.server_starts)


def start_names(server_starts: int) -> list[str]:
    """The variant names of the default engine's starts 2..server_starts: default-start2, default-start3, ..."""
    return [f"default-start{k}" for k in range(2, server_starts + 1)]


def start_number(name: str) -> int | None:
    """k for a name of `start_names` (default-start<k>), else None."""
    k = name.removeprefix("default-start")
    return int(k) if k != name and k.isdigit() else None
