"""Build a random-weight model in a real architecture (Llama-3-8B or Qwen2.5-7B shape) plus a LoRA adapter.

There are no real weights on the GPU host (no hub), so the 8B-class runs use the public
configurations of these models with random weights: speed and memory are real, accuracy is
meaningless (the report says so). The tokenizer is copied from a local directory (the tiny
models' 16k BPE tokenizer), whose ids all fall inside the large vocabulary.

    python bench/make_shaped_model.py --shape llama3-8b --tokenizer .tiny/llama --out /tmp/m/llama3-8b
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

SHAPES = {
    # public config.json values of meta-llama/Meta-Llama-3-8B-Instruct and Qwen/Qwen2.5-7B-Instruct
    "llama3-8b": dict(
        arch="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    "qwen25-7b": dict(
        arch="qwen2",
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    # public config.json of meta-llama/Llama-3.2-1B-Instruct: a model of real size that a CPU quantizes and
    # packages in minutes (the package stage's hashing, measured on the CPU)
    "llama32-1b": dict(
        arch="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    # same architectures at test size, to check this script on a CPU
    "llama-mini": dict(
        arch="llama",
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=16384,
        rope_theta=500000.0,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    "qwen-mini": dict(
        arch="qwen2",
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=16384,
        rope_theta=1000000.0,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
}


def build(shape: str, tokenizer: Path, out: Path, lora_rank: int = 16, seed: int = 0) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import (
        AutoTokenizer,
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    spec = dict(SHAPES[shape])
    arch = spec.pop("arch")
    cfg_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    tok = AutoTokenizer.from_pretrained(tokenizer)
    cfg = cfg_cls(**spec, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, torch_dtype="bfloat16")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.device(device):
        model = model_cls(cfg).to(torch.bfloat16)
    for p in model.parameters():  # small random weights keep activations finite through 32 layers
        torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
    t_init = time.perf_counter() - t0
    base = out / "base"
    model.save_pretrained(base, max_shard_size="5GB")
    tok.save_pretrained(base)
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, do_sample=False).save_pretrained(
        base
    )
    t_save = time.perf_counter() - t0 - t_init
    lcfg = LoraConfig(
        r=lora_rank,
        lora_alpha=2 * lora_rank,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, lcfg)
    for n, p in peft_model.named_parameters():
        if "lora_B" in n:  # B starts at zero (a no-op adapter); make it a real one
            torch.nn.init.normal_(p, std=0.01)
    peft_model.save_pretrained(out / "lora")
    info = {
        "shape": shape,
        "params": sum(p.numel() for p in model.parameters()),
        "device": device,
        "init_s": round(t_init, 2),
        "save_s": round(t_save, 2),
        "lora_rank": lora_rank,
    }
    (out / "shape.json").write_text(json.dumps(info, indent=2))
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--lora-rank", type=int, default=16)
    a = ap.parse_args()
    if (a.out / "shape.json").exists():
        print(f"{a.out} exists; reusing it")
        return
    shutil.rmtree(a.out, ignore_errors=True)
    print(json.dumps(build(a.shape, a.tokenizer, a.out, a.lora_rank)))


if __name__ == "__main__":
    main()
