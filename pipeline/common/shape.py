"""A model's shape, read from its config.json in one place: the dimensions every estimate and check uses.

Pre-flight memory estimates, the group-size and LoRA-shape checks, the merge stage's architecture comparison and vLLM's
KV-cache sizing all need the same few numbers (hidden size, layers, heads, ...). They are parsed here, from the language
model's part of config.json (its `text_config` for multimodal models), so every caller reads them the same way; the
parameter count comes from the safetensors headers where the weights are there, else from the config.

    from quantpipe.common.shape import ModelShape
    s = ModelShape.read("models/llama")           # None when config.json cannot be read
    s.kv_bytes_per_token("fp8")                   # Llama-3-8B: 2 x 32 layers x 8 heads x 128 x 1 byte = 65536
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .hf_config import read_config, text_part
from .safetensors import param_count

# config.json's key for each dimension
KEYS = {
    "hidden": "hidden_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "intermediate": "intermediate_size",
    "vocab": "vocab_size",
    "max_len": "max_position_embeddings",
}
# the dimensions two models of one architecture share (the vocabulary may grow with added tokens)
ARCHITECTURE = ("hidden", "layers", "heads", "kv_heads", "intermediate")
CONTEXT_KEY = KEYS["max_len"]


def _int(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder model. A field is None where config.json does not give it (`kv_heads` falls back to
    `heads` and `head_dim` to hidden // heads, as transformers does); `declared` names the fields config.json sets."""

    hidden: int | None
    layers: int | None
    heads: int | None
    kv_heads: int | None
    head_dim: int | None
    intermediate: int | None
    vocab: int | None
    tied: bool
    max_len: int | None
    logits_rescaled: bool
    declared: frozenset[str]
    counted_params: int | None = None

    @classmethod
    def from_config(cls, cfg: dict, counted_params: int | None = None) -> ModelShape:
        """The shape a config.json dict describes (its text_config for multimodal models)."""
        c = text_part(cfg)
        raw = {f: _int(c.get(k)) for f, k in KEYS.items()}
        h, heads = raw["hidden"], raw["heads"]
        return cls(
            hidden=h,
            layers=raw["layers"],
            heads=heads,
            kv_heads=raw["kv_heads"] or heads,
            head_dim=raw["head_dim"] or (h // heads if h and heads and h >= heads else None),
            intermediate=raw["intermediate"],
            vocab=raw["vocab"],
            tied=bool(cfg.get("tie_word_embeddings", c.get("tie_word_embeddings", False))),
            max_len=raw["max_len"],
            logits_rescaled=any(
                c.get(k) not in (None, 1, 1.0) for k in ("final_logit_softcapping", "logit_scale", "logits_scaling")
            ),
            declared=frozenset(f for f, v in raw.items() if v is not None),
            counted_params=counted_params,
        )

    @classmethod
    def read(cls, model_dir: str | Path) -> ModelShape | None:
        """The shape of the model in `model_dir`; None when its config.json is missing or not a JSON object."""
        d = Path(model_dir)
        cfg = read_config(d)
        if cfg is None:
            return None
        return cls.from_config(cfg, param_count(sorted(d.glob("*.safetensors"))))

    @property
    def complete(self) -> bool:
        """Whether the config gives every dimension the memory estimates need (the MLP width defaults to 4 x hidden)."""
        return None not in (self.hidden, self.layers, self.heads, self.vocab, self.kv_heads, self.head_dim)

    @property
    def exact_head_dim(self) -> int | None:
        """The head size where config.json gives it or the hidden size divides evenly among the heads, else None."""
        if "head_dim" in self.declared or (self.hidden and self.heads and self.hidden % self.heads == 0):
            return self.head_dim
        return None

    @property
    def mlp(self) -> int:
        """The MLP's inner width: config.json's, else 4 x hidden."""
        return self.intermediate or 4 * (self.hidden or 0)

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (attention, gated MLP, two norms; biases left out). Needs `complete`."""
        h, hd = self.hidden, self.head_dim
        return h * self.heads * hd * 2 + h * self.kv_heads * hd * 2 + 3 * h * self.mlp + 2 * h

    @property
    def params(self) -> int:
        """The parameter count: from the safetensors headers where there are weights, else from the config."""
        return self.counted_params or (
            self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * self.layer_params + self.hidden
        )

    @property
    def params_from(self) -> str:
        return "safetensors" if self.counted_params else "config"

    def kv_bytes_per_token(self, kv_cache_dtype: str | None) -> int | None:
        """KV-cache bytes per token over all layers (keys and values; 1 byte an element for fp8 caches, else 2); None
        where the config does not give the layers, heads and head size."""
        if not (self.layers and self.kv_heads and self.head_dim):
            return None
        elt = 1 if (kv_cache_dtype or "auto").startswith("fp8") else 2
        return 2 * self.layers * self.kv_heads * self.head_dim * elt


def architecture_differences(theirs: dict, ours: dict) -> list[str]:
    """ "<key> <theirs> vs <ours>" for each architecture dimension both config dicts set (their text_config parts) and
    that differs."""
    t, o = text_part(theirs), text_part(ours)
    return [f"{k} {t[k]} vs {o[k]}" for k in (KEYS[f] for f in ARCHITECTURE) if k in t and k in o and t[k] != o[k]]
