"""The merge stage on the tiny models: exact LoRA merges on two architectures, refused mismatches,
and a pass-through that copies no weights.

    .venv/quantize/bin/python -m pytest tests/test_merge.py -m "slow or not slow"
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantpipe.recipe import parse
from quantpipe.run.plan import stage_input
from quantpipe.stages import StageError
from quantpipe.stages.merge import run

ARCHS = ("llama", "qwen2")


def make_recipe(tmp: Path, base: Path, adapters: list[tuple[Path, float]] = ()):
    lines = ["name: merge-test", f"output_dir: {tmp / 'out'}", "base:", f"  model: {base}", "  dtype: bfloat16"]
    if adapters:
        lines.append("adapters:")
        lines += [f"  - path: {p}\n    weight: {w}" for p, w in adapters]
    lines += ["artifacts:", "  - name: fp8", "    method: fp8"]
    return parse("\n".join(lines) + "\n", tmp, check_files=False)


def merge(tmp: Path, base: Path, adapters: list[tuple[Path, float]] = ()) -> tuple[Path, dict]:
    out = tmp / "merged"
    out.mkdir()
    return out, run(stage_input("merge", make_recipe(tmp, base, adapters), None, base), base, out)


def read_tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors |= load_file(f)
    return tensors


def expected_weight(base: dict, adapter: dict, module: str, scale: float):
    """bf16(W + scale * B @ A): what an exact merge must store."""
    import torch

    a = adapter[f"base_model.model.{module}.lora_A.weight"].float()
    b = adapter[f"base_model.model.{module}.lora_B.weight"].float()
    return (base[f"{module}.weight"].float() + scale * (b @ a)).to(torch.bfloat16)


# --- fast: bad inputs refused before anything loads ---------------------------------------------


def test_base_that_is_an_adapter_is_refused(tmp_path):
    fake = tmp_path / "lora"
    fake.mkdir()
    (fake / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    (fake / "config.json").write_text("{}")
    out = tmp_path / "o"
    out.mkdir()
    with pytest.raises(StageError, match="is a LoRA adapter, not a model.*adapters"):
        run(stage_input("merge", make_recipe(tmp_path, fake), None, fake), fake, out)


def test_base_without_config_is_refused(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    with pytest.raises(StageError, match="no config.json"):
        run(stage_input("merge", make_recipe(tmp_path, tmp_path), None, tmp_path), tmp_path, out)


@pytest.mark.parametrize("adapters", [False, True])
def test_a_link_leaving_an_input_folder_is_refused_before_anything_reaches_the_cache(tmp_path, adapters):
    """With adapters (a copy of the template) or without (the base passed through as links), the stage refuses."""
    secret = tmp_path / "secret.txt"
    secret.write_text("private")
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    lora = tmp_path / "lora"
    lora.mkdir()
    (lora / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    ((lora if adapters else base) / "chat_template.jinja").symlink_to(secret)
    out = tmp_path / "o"
    out.mkdir()
    recipe = make_recipe(tmp_path, base, [(lora, 1.0)] if adapters else [])
    with pytest.raises(StageError, match=r"(adapters\.0\.path|base\.model): .* holds links to files outside it"):
        run(stage_input("merge", recipe, None, base), base, out)
    assert not any(out.iterdir())


# --- slow: the tiny models -------------------------------------------------------------------


@pytest.fixture(scope="module", params=ARCHS)
def merged(request, tiny, tmp_path_factory):
    arch = request.param
    base, lora = getattr(tiny, arch), getattr(tiny, f"{arch}_lora")
    out, metrics = merge(tmp_path_factory.mktemp(f"merge-{arch}"), base, [(lora, 1.0)])
    return arch, base, lora, out, metrics


@pytest.mark.slow
def test_merged_weights_are_base_plus_scaled_delta(merged):
    import torch

    arch, base, lora, out, metrics = merged
    conf = json.loads((lora / "adapter_config.json").read_text())
    scale = conf["lora_alpha"] / conf["r"]
    w_base, w_ad, w_out = read_tensors(base), read_tensors(lora), read_tensors(out)
    assert set(w_out) == set(w_base)  # same tensors, no lora_* left, nothing renamed
    targets = sorted({k.removeprefix("base_model.model.").rsplit(".lora_A", 1)[0] for k in w_ad if ".lora_A" in k})
    assert len(targets) == 4 * 7, targets  # 4 layers x q,k,v,o,gate,up,down
    changed = 0
    for m in targets:
        want = expected_weight(w_base, w_ad, m, scale)
        torch.testing.assert_close(w_out[f"{m}.weight"].float(), want.float(), rtol=2**-7, atol=1e-7)
        changed += int(not torch.equal(w_out[f"{m}.weight"], w_base[f"{m}.weight"]))
    assert changed == len(targets)
    untouched = [k for k in w_base if not any(k.startswith(m + ".weight") for m in targets)]
    assert all(torch.equal(w_out[k], w_base[k]) for k in untouched)
    assert all(t.dtype == torch.bfloat16 for t in w_out.values())


@pytest.mark.slow
def test_merged_logits_match_base_plus_adapter(merged):
    """The stage's own check, recorded in metrics, and an independent one on the saved files."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    arch, base, lora, out, metrics = merged
    assert metrics["n_adapters"] == 1
    assert 0 <= metrics["merge_max_abs_diff"] <= metrics["merge_tolerance"] < 0.1
    assert metrics["adapter_logit_shift"] > 1.0  # the adapter really moves the model
    assert metrics["dtype"] == "bfloat16" and metrics["params"] > 5_000_000

    tok = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor(
        [tok("What is the capital of Norvia? The colour of the zarp is", add_special_tokens=False)["input_ids"]]
    )
    with torch.no_grad():
        m = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        base_logits = m(input_ids=ids).logits
        peft_logits = PeftModel.from_pretrained(m, lora).eval()(input_ids=ids).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(input_ids=ids).logits
    shift = (peft_logits - base_logits).abs().max().item()
    err = (merged_logits - peft_logits).abs().max().item()
    assert shift > 1.0
    # The saved model is bf16 (weights rounded once after the merge): far closer to base+adapter than base is.
    assert err < 0.05 * shift, (err, shift)


@pytest.mark.slow
def test_merged_folder_is_a_plain_model(merged):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    arch, base, lora, out, metrics = merged
    names = {p.name for p in out.iterdir()}
    assert not any(n.startswith("adapter_") for n in names), names
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= names
    assert not any(p.is_symlink() for p in out.iterdir())
    assert metrics["size_bytes"] == (out / "model.safetensors").stat().st_size
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template and tok.chat_template == AutoTokenizer.from_pretrained(base).chat_template
    assert (
        json.loads((out / "generation_config.json").read_text())["eos_token_id"]
        == json.loads((base / "generation_config.json").read_text())["eos_token_id"]
    )
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == arch and model.dtype == torch.bfloat16
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 3 plus 4?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    gen = model.generate(**ids, max_new_tokens=6, do_sample=False)
    assert gen.shape[1] > ids["input_ids"].shape[1]


@pytest.mark.slow
def test_adapter_for_another_architecture_is_refused(tiny, tmp_path):
    with pytest.raises(StageError) as e:
        merge(tmp_path, tiny.llama, [(tiny.qwen2_lora, 1.0)])
    msg = str(e.value)
    assert "qwen2-lora" in msg and "qwen2" in msg and "llama" in msg and "set base.model" in msg
    assert not any((tmp_path / "merged").iterdir())  # refused before anything was written


@pytest.mark.slow
def test_adapter_with_other_shapes_is_refused(tiny, tmp_path):
    """An adapter whose base is a hub id (not checkable offline) is caught by its tensor shapes."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    other = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=16384,
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    pm = get_peft_model(other, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    pm.peft_config["default"].base_model_name_or_path = "someone/llama-other-size"
    pm.save_pretrained(tmp_path / "other-lora")
    with pytest.raises(StageError, match=r"does not fit base\.model \(LlamaForCausalLM.*q_proj.*set base\.model"):
        merge(tmp_path, tiny.llama, [(tmp_path / "other-lora", 1.0)])


@pytest.mark.slow
def test_adapter_weights_scale_the_delta(tiny, tmp_path):
    """Two adapters merge as the weighted sum of their deltas: A x 0.25 + A x 0.5 == A x 0.75."""
    import torch

    out, metrics = merge(tmp_path, tiny.llama, [(tiny.llama_lora, 0.25), (tiny.llama_lora, 0.5)])
    assert metrics["n_adapters"] == 2 and metrics["merge_max_abs_diff"] <= metrics["merge_tolerance"]
    conf = json.loads((tiny.llama_lora / "adapter_config.json").read_text())
    w_base, w_ad, w_out = read_tensors(tiny.llama), read_tensors(tiny.llama_lora), read_tensors(out)
    for m in ("model.layers.0.self_attn.q_proj", "model.layers.3.mlp.down_proj"):
        want = expected_weight(w_base, w_ad, m, 0.75 * conf["lora_alpha"] / conf["r"])
        torch.testing.assert_close(w_out[f"{m}.weight"].float(), want.float(), rtol=2**-7, atol=1e-7)
        full = expected_weight(w_base, w_ad, m, conf["lora_alpha"] / conf["r"])
        assert not torch.allclose(w_out[f"{m}.weight"].float(), full.float(), rtol=2**-7, atol=1e-7)


@pytest.mark.slow
def test_no_adapters_links_the_base(tiny, tmp_path):
    out, metrics = merge(tmp_path, tiny.llama)
    entries = list(out.iterdir())
    assert entries and all(p.is_symlink() for p in entries)  # no weight was copied
    assert {p.name for p in entries} == {p.name for p in tiny.llama.iterdir()}
    for p in entries:
        assert p.resolve() == (tiny.llama / p.name).resolve() and Path(p.readlink()).is_absolute()
    assert metrics["n_adapters"] == 0 and metrics["merge_max_abs_diff"] is None
    assert (
        metrics["params"] == sum(t.numel() for t in read_tensors(tiny.llama).values())
        and metrics["dtype"] == "bfloat16"
    )
    assert metrics["size_bytes"] == (tiny.llama / "model.safetensors").stat().st_size
