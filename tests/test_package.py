"""Package stage and `quantpipe verify`: a real quantized tiny model (llm-compressor, W4A16 round-to-nearest,
data-free) packaged into a Hugging Face directory, verified, damaged, re-sharded and loaded back.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from quantpipe.recipe import Recipe
from quantpipe.run.plan import stage_input
from quantpipe.stages import StageError
from quantpipe.stages.contract import Upstream
from quantpipe.stages.package import parse_size, run, serve_command, verify_package

ART = "w4"
EVAL = {
    "artifact": ART,
    "method": "rtn",
    "settings": {"backend": "hf"},
    "lm_eval": {"tiny_qa": {"exact_match": 0.52}},
    "validation": {"metric": "exact_match", "score": 0.6, "n": 50},
    "fidelity": {"kl_mean": 0.00052, "top1_agreement": 0.981, "ppl": 141.2, "ppl_baseline": 140.9},
    "comparison": [
        {
            "task": "tiny_qa",
            "metric": "exact_match",
            "baseline": 0.55,
            "artifact": 0.52,
            "recovery": 0.945,
            "ci95": [0.901, 0.987],
            "flip_rate": 0.06,
            "n": 200,
        }
    ],
}
BENCH = {
    "artifact": ART,
    "method": "rtn",
    "servable": True,
    "reason": None,
    "platform": "cpu",
    "results": [
        {
            "variant": v,
            "workload": "fixed",
            "concurrency": c,
            "request_throughput": 1.5 * c,
            "output_throughput": 96.0 * c,
            "total_token_throughput": 288.0 * c,
            "ttft_ms": {"mean": 60, "p50": 55, "p90": 80, "p99": 120},
            "tpot_ms": {"mean": 22, "p50": 21, "p90": 25, "p99": 31},
            "itl_ms": {"mean": 22, "p50": 21, "p90": 25, "p99": 31},
            "e2el_ms": {"mean": 1500, "p50": 1450, "p90": 1700, "p99": 1900},
            "goodput": 1.4 * c,
            "completed": 32,
            "failed": 0,
            "duration_s": 20.0,
        }
        for v in ("default", "eager")
        for c in (1, 4)
    ],
    "offline": {"latency_s_batch1": 1.234, "throughput_req_s": 2.0, "throughput_tok_s": 130.5},
    "memory": {
        "weights_gib": 0.004,
        "kv_cache_tokens": 16384,
        "peak_rss_gib": 3.2,
        "prefix_cache_hit_rate": 0.0,
        "preemptions": 0,
    },
    "best": {"variant": "eager", "concurrency": 4, "goodput": 5.6, "reason": "highest goodput within the SLO"},
    "variants": {
        "default": {"engine": {"dtype": "bfloat16", "kv_cache_memory_bytes": 268435456}, "servable": True},
        "eager": {
            "engine": {
                "dtype": "bfloat16",
                "max_num_seqs": 8,
                "enforce_eager": True,
                "kv_cache_memory_bytes": 268435456,
            },
            "servable": True,
        },
    },
    "lora": None,
    "server_start_s": 30.5,
}


def _recipe(tmp: Path, base: Path, notes: str | None = None, **package) -> Recipe:
    return Recipe.model_validate(
        {
            "name": "tinypkg",
            "notes": notes,
            "output_dir": str(tmp / "out"),
            "base": {"model": str(base)},
            "artifacts": [{"name": ART, "method": "rtn", "bits": 4, "group_size": 128}],
            "benchmark": {
                "engine": {"kv_cache_memory_bytes": 268435456},
                "slo": {"ttft_p99_ms": 500},
                "variants": [{"name": "eager", "engine": {"enforce_eager": True, "max_num_seqs": 8}}],
            },
            "package": package,
        }
    )


def _entry(cache: Path, stage: str, key: str, metrics: dict, src: Path | None = None) -> Path:
    """A stage output laid out as the runner's cache does (<cache>/stages/<kind>/<name>/<key>/out + entry.json)."""
    entry = cache / "stages" / stage.replace(":", "/") / key
    out = entry / "out"
    if src is not None:
        shutil.copytree(src, out)
    else:
        out.mkdir(parents=True)
    (entry / "entry.json").write_text(json.dumps({"metrics": metrics, "wall_s": 1.5, "stage": stage, "key": key}))
    return out


def make_tiny_base(base: Path) -> Path:
    """A random tiny Llama (bf16 safetensors) with a word-level tokenizer, a chat template and a card with a license."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(base)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(1021)}}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tok.save_pretrained(base)
    (base / "README.md").write_text("---\nlicense: apache-2.0\nlanguage: en\n---\n# tiny base\n")
    return base


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny base, and its llm-compressor W4A16 (round-to-nearest, data-free) quantization laid out as cache entries."""
    import torch
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("pkg")
    base = make_tiny_base(root / "base")

    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    m = LlamaForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    oneshot(model=m, recipe=QuantizationModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"]))
    cache = root / "cache"
    merged = _entry(cache, "merge", "m" * 32, {"wall_s": 2.0}, src=base)
    quant = cache / "stages" / "quantize" / ART / ("q" * 32) / "out"
    m.save_pretrained(quant, save_compressed=True)  # no tokenizer here: the package takes it from the merged model
    (quant.parent / "entry.json").write_text(
        json.dumps(
            {
                "metrics": {
                    "method": "rtn",
                    "scheme": "W4A16",
                    "size_bytes": 1_600_000,
                    "baseline_size_bytes": 2_400_000,
                    "compression": 1.5,
                    "calibration_sha256": None,
                    "n_calibration_samples": 0,
                    "oneshot_s": 0.4,
                    "save_s": 0.2,
                    "wall_s": 3.0,
                },
                "wall_s": 3.0,
            }
        )
    )
    (quant / "adapter_config.json").write_text("{}")  # must not reach the package
    refs = {
        "evaluation": _entry(cache, f"evaluate:{ART}", "e" * 32, EVAL),
        "baseline_eval": _entry(
            cache, "evaluate:baseline", "f" * 32, {"validation": {"metric": "exact_match", "score": 0.62, "n": 50}}
        ),
        "benchmark": _entry(cache, f"benchmark:{ART}", "b" * 32, BENCH),
        "baseline_benchmark": _entry(
            cache,
            "benchmark:baseline",
            "c" * 32,
            {**BENCH, "offline": {"latency_s_batch1": 1.9, "throughput_tok_s": 100.0}},
        ),
    }
    return {"root": root, "base": base, "merged": merged, "quant": quant, "refs": refs, "cache": cache}


def _record(out: Path) -> Upstream:
    """What the runner hands a stage for an upstream entry: its output directory and entry.json's record."""
    rec = json.loads((out.parent / "entry.json").read_text())
    return Upstream(
        out=out,
        stage=rec.get("stage", "quantize:" + ART),
        key=rec.get("key", out.parent.name),
        wall_s=rec.get("wall_s"),
        metrics=rec["metrics"],
    )


def _upstream(model, **extra) -> dict:
    return {
        "quantize": _record(model["quant"]),
        "merged": _record(model["merged"]),
        **{k: _record(v) for k, v in model["refs"].items()},
        **extra,
    }


def _package(model, tmp: Path, name: str, notes: str | None = None, **package) -> tuple[Path, dict]:
    out = model["cache"] / "stages" / "package" / ART / f".{name}.tmp-1-2" / "out"
    shutil.rmtree(out.parent, ignore_errors=True)
    out.mkdir(parents=True)
    recipe = _recipe(tmp, model["base"], notes, **package)
    own = Upstream(out=out, stage=f"package:{ART}", key=name)
    metrics = run(stage_input("package", recipe, ART, model["base"]), model["quant"], out, _upstream(model, self=own))
    return out, metrics


@pytest.fixture(scope="module")
def pkg(model, tmp_path_factory):
    return _package(model, tmp_path_factory.mktemp("p"), "p" * 32)


@pytest.mark.slow
def test_package_layout_and_verify_ok(pkg):
    out, metrics = pkg
    names = {p.name for p in out.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "README.md",
        "manifest.json",
        "recipe.yaml",
    } <= names
    assert "adapter_config.json" not in names and "adapter_config.json" in metrics["skipped"]
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "pack-quantized"
    assert metrics["resharded"] is False and metrics["shards"] == 1 and metrics["chat_template"] is True
    assert verify_package(out) == []


@pytest.mark.slow
def test_shards_are_hard_links_to_the_quantize_entry(model, pkg):
    """The cache holds an artifact's weights once: the package entry links the quantize entry's shards."""
    out, metrics = pkg
    assert metrics["hardlinked_shards"] == 1
    assert (out / "model.safetensors").stat().st_ino == (model["quant"] / "model.safetensors").stat().st_ino


@pytest.mark.slow
def test_manifest_records_hashes_keys_and_provenance(pkg):
    import hashlib

    out, _ = pkg
    man = json.loads((out / "manifest.json").read_text())
    assert set(man["files"]) == {p.name for p in out.iterdir()} - {"manifest.json"}
    st = man["files"]["model.safetensors"]
    assert (
        st["sha256"] == hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
        and st["size"] == (out / "model.safetensors").stat().st_size
    )
    assert man["stage_keys"] == {
        "merge": "m" * 32,
        f"quantize:{ART}": "q" * 32,
        f"evaluate:{ART}": "e" * 32,
        "evaluate:baseline": "f" * 32,
        f"benchmark:{ART}": "b" * 32,
        "benchmark:baseline": "c" * 32,
        f"package:{ART}": "p" * 32,
    }
    assert (
        man["recipe"]["artifact"]["name"] == ART and man["trust_remote_code"] is False and man["allow_pickle"] is False
    )
    assert man["timings_s"][f"quantize:{ART}"] == 3.0
    assert man["hardware"]["cpus"] and "quantize" in man["versions"] and "git_commit" in man["quantpipe"]


@pytest.mark.slow
def test_model_card_front_matter_and_body(pkg):
    from huggingface_hub import ModelCard

    out, _ = pkg
    card = ModelCard.load(out / "README.md")
    d = card.data.to_dict()
    assert d["base_model"] == "base" and d["base_model_relation"] == "quantized" and d["library_name"] == "transformers"
    assert d["license"] == "apache-2.0"  # carried from the base model's card
    assert "rtn" in d["tags"] and "w4a16" in d["tags"]
    body = card.text
    assert "| tiny_qa | exact_match | 0.550 | 0.520 | 0.945 | [0.901, 0.987] |" in body
    # the best variant's arguments, as the benchmark served with them
    assert (
        "vllm serve ./w4 --dtype bfloat16 --max-num-seqs 8 --enforce-eager --kv-cache-memory-bytes 268435456\n" in body
    )
    assert "`eager` best (at concurrency 4)" in body
    assert "batch-1 latency 1.234 s (baseline 1.900 s)" in body
    assert "mean next-token KL divergence 0.00052" in body


@pytest.mark.slow
def test_license_from_recipe_overrides_base(model, tmp_path):
    from huggingface_hub import ModelCard

    out, m = _package(model, tmp_path, "l" * 32, notes="Random weights:\naccuracy means nothing.", license="mit")
    card = ModelCard.load(out / "README.md")
    assert m["license"] == "mit" and card.data.license == "mit"
    assert "> **Note:** Random weights: accuracy means nothing." in card.text  # the recipe's notes, one line


@pytest.mark.slow
def test_hostile_notes_and_license_render_as_text_in_the_model_card(model, tmp_path):
    """The recipe's notes and package.license, each holding HTML, a javascript: link, a tracking image, a table pipe and
    a backtick: the card (packages/<artifact>/README.md) shows them as text, and its tables keep their columns."""
    from markdown_it import MarkdownIt

    hostile = "<script>alert(1)</script> [click](javascript:alert(1)) ![t](http://tracker.example/p.png) a|b `x"
    out, _ = _package(model, tmp_path, "h" * 32, notes=hostile, license=hostile)
    text = (out / "README.md").read_text()
    body = text.split("\n---\n", 1)[1]  # after the front matter (YAML, which quotes the license)
    html = MarkdownIt("commonmark").enable("table").render(body)
    assert "<script" not in html and 'href="javascript' not in html and 'src="http://tracker' not in html, html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html and html.count("&lt;script&gt;") == 2
    assert "<td>a|b" not in html  # the pipe did not end the License cell early
    assert "| License | " in body and body.split("| License | ")[1].split("\n")[0].endswith("(from the recipe) |")


@pytest.mark.slow
def test_verify_names_a_flipped_byte(pkg, tmp_path):
    from click.testing import CliRunner

    from quantpipe.cli import main

    d = tmp_path / "copy"
    shutil.copytree(pkg[0], d)
    assert CliRunner().invoke(main, ["verify", str(d)]).exit_code == 0
    st = d / "model.safetensors"
    data = bytearray(st.read_bytes())
    data[len(data) // 2] ^= 0x01
    st.write_bytes(bytes(data))
    problems = verify_package(d)
    assert problems == ["model.safetensors: content changed (sha256 differs from manifest.json)"]
    r = CliRunner().invoke(main, ["verify", str(d)])
    assert r.exit_code == 1 and "MISMATCH model.safetensors" in r.output
    (d / "README.md").write_text((d / "README.md").read_text().replace("0.945", "0.995"))
    assert any(p.startswith("README.md: content changed") for p in verify_package(d))


@pytest.mark.slow
def test_reshard_loads_in_transformers_and_verify_catches_damage(model, pkg, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    out, m = _package(model, tmp_path, "r" * 32, max_shard_size="100KB")
    assert m["resharded"] and m["shards"] > 3
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == sorted(p.name for p in out.glob("*.safetensors")) and len(shards) == m["shards"]
    assert verify_package(out) == []
    ids = torch.tensor([[1, 5, 9, 200, 17]])
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
        b = AutoModelForCausalLM.from_pretrained(pkg[0]).eval()(ids).logits  # the single-file package
    assert torch.equal(a, b) and a.abs().sum() > 0  # same tensors, other shards
    # a missing shard, an extra file
    d = tmp_path / "damaged"
    shutil.copytree(out, d)
    (d / shards[1]).unlink()
    (d / "notes.txt").write_text("hi")
    problems = verify_package(d)
    assert f"{shards[1]}: missing (listed in manifest.json)" in problems
    assert any(p.startswith(f"{shards[1]}: missing, named in model.safetensors.index.json") for p in problems)
    assert "notes.txt: extra file, not in manifest.json" in problems


@pytest.mark.slow
def test_verify_checks_index_against_headers_even_with_a_matching_manifest(model, tmp_path):
    """A package re-hashed after a bad edit passes the hash check; the structural check still names the file."""
    import hashlib

    out, _ = _package(model, tmp_path, "s" * 32, max_shard_size="100KB")
    idx = out / "model.safetensors.index.json"
    index = json.loads(idx.read_text())
    tensor, shard = next(iter(index["weight_map"].items()))
    other = next(s for s in sorted(set(index["weight_map"].values())) if s != shard)
    index["weight_map"][tensor] = other
    idx.write_text(json.dumps(index))
    man = json.loads((out / "manifest.json").read_text())
    man["files"][idx.name] = {"size": idx.stat().st_size, "sha256": hashlib.sha256(idx.read_bytes()).hexdigest()}
    (out / "manifest.json").write_text(json.dumps(man))
    problems = verify_package(out)
    assert f"{other}: has no tensor {tensor}, which model.safetensors.index.json places there" in problems
    assert any(p.startswith(f"{shard}: tensor {tensor} is not mapped to it") for p in problems)


@pytest.mark.slow
def test_refuses_an_unquantized_model(model, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(StageError, match="no quantization_config"):
        run(
            stage_input("package", _recipe(tmp_path, model["base"]), ART, model["base"]),
            model["base"],
            out,
            {"merged": _record(model["merged"])},
        )


def test_verify_without_manifest(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert verify_package(tmp_path) == [
        "manifest.json: missing or unreadable; this is not a quantpipe package (or the manifest was damaged)"
    ]
    assert verify_package(tmp_path / "nope")[0].endswith("not a directory")


def test_verify_refuses_what_is_not_a_package_as_bad_input(tmp_path):
    """Exit 2 naming the fix for a path that is no package; exit 1 stays for a package that does not verify."""
    from click.testing import CliRunner

    from quantpipe.cli import main

    (tmp_path / "config.json").write_text("{}")
    for path, says in ((tmp_path / "nope", "not a directory"), (tmp_path, "no manifest.json there")):
        r = CliRunner().invoke(main, ["verify", str(path)])
        assert r.exit_code == 2 and says in r.output and "<output_dir>/packages/<artifact>" in r.output
    (tmp_path / "manifest.json").write_text("{not json")
    r = CliRunner().invoke(main, ["verify", str(tmp_path)])
    assert r.exit_code == 1 and "manifest.json: missing or unreadable" in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "manifest.json"]


def test_parse_size_reads_the_units_max_shard_size_allows():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("512MiB") == 512 * 2**20 and parse_size("1.5 KB") == 1500
    with pytest.raises(StageError, match="not a size"):
        parse_size("5 parsecs")


def test_serve_command_from_the_recipe_when_the_benchmark_recorded_no_engine(tmp_path):
    r = _recipe(tmp_path, tmp_path)
    best = {"best": {"variant": "eager", "concurrency": 4}}
    assert (
        serve_command(r, ART, best)["command"]
        == "vllm serve ./w4 --max-num-seqs 8 --enforce-eager --kv-cache-memory-bytes 268435456"
    )
    # no variant met the SLO: the default engine, and the card says why
    none = serve_command(r, ART, {"best": {"variant": None, "reason": "no variant meets the SLO"}})
    assert (
        none["command"] == "vllm serve ./w4 --kv-cache-memory-bytes 268435456"
        and none["reason"] == "no variant meets the SLO"
    )
