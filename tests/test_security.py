"""Security: safe YAML, no pickle unless opted in, trust_remote_code off and recorded, no path escapes, the server on
127.0.0.1 only, secrets never written. Fast tests, plus one real small run (tiny Llama, one FP8 artifact) and one
parse of the server's command line by vLLM's own parser (both `slow`).

    .venv/quantize/bin/python -m pytest tests/test_security.py -q -m "slow or not slow"
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from helpers.fakes import safetensors

from quantpipe.cache import StageCache
from quantpipe.cli import main
from quantpipe.ports import HOST
from quantpipe.recipe import Recipe, load
from quantpipe.run.plan import build_steps
from quantpipe.run.process import RedactFilter as _RedactFilter
from quantpipe.run.process import redact, secrets
from quantpipe.run.publish import PublishError, publish
from quantpipe.run.record import RunRecord, write_record
from quantpipe.run.runner import Runner
from quantpipe.server import Server

REPO = Path(__file__).resolve().parents[1]
SERVE_PY = REPO / ".venv" / "serve" / "bin" / "python"
PLANTED = {
    "HF_TOKEN": "hf_plantedTOKENv1xQ9zzLk3",
    "MY_API_SECRET": "sk-planted-secret-7c1e9b",
    "HUGGING_FACE_HUB_TOKEN": "hf_plantedHUBtoken42abc",
}


@pytest.fixture
def fake(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    safetensors(model / "model.safetensors", {"w": [1]})
    (model / "tokenizer_config.json").write_text("{}")
    (tmp_path / "cal.jsonl").write_text('{"text": "hello"}\n')
    return tmp_path


def recipe_dict(**over) -> dict:
    d = {
        "name": "sec",
        "output_dir": "out",
        "base": {"model": "model"},
        "calibration": {"sources": [{"path": "cal.jsonl"}]},
        "artifacts": [{"name": "fp8", "method": "fp8"}],
    }
    d.update(over)
    return d


def write(tmp_path: Path, data, name: str = "r.yaml") -> Path:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return p


def refused(res, tmp_path: Path, needle: str = "") -> None:
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and needle in res.output, res.output
    assert not (tmp_path / "out").exists()


# --- YAML: safe_load only -----------------------------------------------------------------------

PAYLOADS = [
    "!!python/object/apply:os.system ['touch {marker}']",
    "!!python/object/apply:subprocess.check_call [['touch', '{marker}']]",
    "!!python/object/new:subprocess.Popen [['touch', '{marker}']]",
    "!!python/name:os.system",
    "!!python/module:os",
]


@pytest.mark.parametrize("where", ["document", "value", "key"])
@pytest.mark.parametrize(
    "payload", PAYLOADS, ids=["apply-os.system", "apply-check_call", "new-Popen", "name", "module"]
)
def test_python_yaml_tags_are_refused_and_never_run(fake, payload, where):
    marker = fake / "PWNED"
    tag = payload.format(marker=marker)
    text = {
        "document": tag + "\n",
        "value": yaml.safe_dump(recipe_dict()) + f"name2: {tag}\n",
        "key": yaml.safe_dump(recipe_dict()) + f"? {tag}\n: 1\n",
    }[where]
    res = CliRunner().invoke(main, ["run", str(write(fake, text))])
    refused(res, fake, "not valid YAML")
    assert not marker.exists()


def test_no_unsafe_deserialisation_in_the_code():
    """safe_load only; no pickle.load, no torch.load without weights_only (a regression here is a code-execution hole)."""
    bad = re.compile(
        r"yaml\.(load|unsafe_load|full_load)\(|Loader=yaml\.(Loader|FullLoader|UnsafeLoader)|pickle\.loads?\(|torch\.load\((?![^)]*weights_only=True)"
    )
    hits = [
        f"{p.relative_to(REPO)}:{n}"
        for p in sorted((REPO / "pipeline").rglob("*.py")) + sorted((REPO / "scripts").glob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if bad.search(line)
    ]
    assert hits == []


# --- pickle weights: refused unless the recipe opts in --------------------------------------------


def test_pickle_only_model_and_adapter_are_refused_unless_allowed(fake):
    (fake / "model" / "model.safetensors").unlink()
    (fake / "model" / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")
    adapter = fake / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    (adapter / "adapter_model.bin").write_bytes(b"\x80\x04K\x01.")
    d = recipe_dict(adapters=[{"path": "adapter"}])
    res = CliRunner().invoke(main, ["check", str(write(fake, d))])
    refused(res, fake, "pickle")
    assert "base.model" in res.output and "adapters.0.path" in res.output
    d["base"]["allow_pickle"] = True
    res = CliRunner().invoke(main, ["check", str(write(fake, d))])
    assert res.exit_code == 0, res.output
    assert load(write(fake, d)).base.allow_pickle is True


# --- trust_remote_code: off unless asked, and passed on only then ---------------------------------


def test_trust_remote_code_is_off_by_default_and_reaches_vllm_only_when_asked(fake):
    from quantpipe.stages.benchmark.engine import effective_engine

    r = load(write(fake, recipe_dict()))
    assert r.base.trust_remote_code is False
    engine, _ = effective_engine(r.benchmark.engine, r, fake / "model", {"platform": "cuda"}, 128)
    assert "trust_remote_code" not in engine
    r = load(write(fake, recipe_dict(base={"model": "model", "trust_remote_code": True})))
    engine, _ = effective_engine(r.benchmark.engine, r, fake / "model", {"platform": "cuda"}, 128)
    assert engine["trust_remote_code"] is True


# --- paths built from recipe input stay inside their directories -------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "../evil",
        "..",
        ".",
        "/etc",
        "a/b",
        "a\\b",
        "a/../../b",
        "~root",
        "a\x00b",
        "ａ",
        "-x",
        "x" * 65,
        " x",
        "Evil",
        "",
    ],
)
def test_artifact_and_recipe_names_cannot_be_paths(fake, name):
    res = CliRunner().invoke(main, ["run", str(write(fake, recipe_dict(artifacts=[{"name": name, "method": "fp8"}])))])
    refused(res, fake, "artifact name")
    res = CliRunner().invoke(main, ["run", str(write(fake, recipe_dict(name=name)))])
    refused(res, fake, "recipe name")


def test_every_derived_path_stays_inside_its_root(fake):
    """Names at the edge of what is allowed: cache entries, stage logs and published packages stay inside their roots."""
    names = ["a..b", "x.-_9", "0" * 64, "a..", "z."]
    r = Recipe.model_validate(
        {
            **recipe_dict(),
            "output_dir": str(fake / "out"),
            "base": {"model": str(fake / "model")},
            "calibration": None,
            "artifacts": [{"name": n, "method": "fp8"} for n in names],
        }
    )
    cache = StageCache(fake / "cache")
    run_dir = fake / "out" / "runs" / "r1"
    for s in build_steps(r, str(fake / "model")):
        assert cache.entry(s.id, "k" * 32).resolve().is_relative_to((fake / "cache" / "stages").resolve()), s.id
        assert (run_dir / "logs" / f"{s.id.replace(':', '_')}.log").resolve().parent == (run_dir / "logs").resolve(), (
            s.id
        )


def test_publish_never_writes_through_a_planted_link(fake, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside")
    (outside / "keep.txt").write_text("precious")
    r = Recipe.model_validate(
        {**recipe_dict(), "output_dir": str(fake / "out"), "base": {"model": str(fake / "model")}, "calibration": None}
    )
    out_dir = Path(r.output_dir)
    pkg = fake / "built"
    pkg.mkdir()
    (pkg / "manifest.json").write_text("{}")
    # packages/<artifact> planted as a link to a directory outside: replaced by our link, the target untouched
    (fake / "out" / "packages").mkdir(parents=True)
    (fake / "out" / "packages" / "fp8").symlink_to(outside, target_is_directory=True)
    link = publish(out_dir, "fp8", pkg, "a" * 32)
    assert link.resolve().is_relative_to((fake / "out").resolve()) and (link / "manifest.json").is_file()
    assert (
        sorted(p.name for p in outside.iterdir()) == ["keep.txt"] and (outside / "keep.txt").read_text() == "precious"
    )
    # packages/.store planted as a link outside: refused, nothing written there
    store = fake / "out" / "packages" / ".store"
    for p in store.iterdir():
        if p.is_dir():
            import shutil

            shutil.rmtree(p)
    store.rmdir()
    store.symlink_to(outside, target_is_directory=True)
    with pytest.raises(PublishError, match="symbolic link"):
        publish(out_dir, "fp8", pkg, "b" * 32)
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"]


# --- the benchmark server: 127.0.0.1 only ------------------------------------------------------------

HOST_FLAGS = [["--host", "0.0.0.0"], ["--host=0.0.0.0"], ["-q", "awq"], ["--quantization=fp8"]]


@pytest.mark.parametrize("extra", HOST_FLAGS, ids=["host", "host=", "-q", "quantization="])
def test_recipe_cannot_set_the_host(fake, extra):
    res = CliRunner().invoke(main, ["run", str(write(fake, recipe_dict(benchmark={"engine": {"extra_args": extra}})))])
    refused(res, fake, "is set by quantpipe")


SNEAKY = [["--hos", "0.0.0.0"], ["--ho=0.0.0.0"], ["--max-model-len", "64", "--hos", "::"]]


def server_command(extra: list[str], tmp_path: Path) -> list[str]:
    s = Server("/m", extra, log_path=tmp_path / "s.log")
    s.port = 8000  # chosen at start(); any port for reading the command
    return s.command()


def test_server_command_binds_loopback(tmp_path):
    assert HOST == "127.0.0.1"
    for extra in SNEAKY:
        cmd = server_command(extra, tmp_path)
        hosts = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--host"]
        assert hosts == ["127.0.0.1"], cmd
        assert cmd.index("--host") > max(cmd.index(a) for a in extra), (
            "our --host must come last: argparse keeps the last value"
        )


@pytest.mark.slow
def test_vllm_parses_our_server_command_to_loopback(tmp_path):
    """vLLM's own argument parser (abbreviations, --config files) ends with host 127.0.0.1 for sneaky extra args."""
    if not SERVE_PY.exists():
        pytest.fail(f"the serve environment is missing ({SERVE_PY}); run scripts/setup_envs.sh serve", pytrace=False)
    cfg = tmp_path / "engine.yaml"
    cfg.write_text("host: 0.0.0.0\nport: 80\n")
    cases = [*SNEAKY, ["--config", str(cfg)]]
    cmds = [server_command(extra, tmp_path)[3:] for extra in cases]  # from `serve` on
    helper = Path(__file__).parent / "helpers" / "vllm_serve_host.py"  # the parser `vllm serve` itself builds
    r = subprocess.run([str(SERVE_PY), str(helper), json.dumps(cmds)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == ["127.0.0.1"] * len(cases)


# --- secrets -------------------------------------------------------------------------------------


def test_secrets_are_redacted_from_stage_logs_run_log_and_run_json(tmp_path, monkeypatch):
    for k, v in PLANTED.items():
        monkeypatch.setenv(k, v)
    assert set(PLANTED.values()) <= set(secrets())
    r = Recipe.model_validate(
        {**recipe_dict(), "output_dir": str(tmp_path / "out"), "base": {"model": str(tmp_path)}, "calibration": None}
    )
    runner = Runner(r, tmp_path / "r.yaml")
    stage_log = io.StringIO()
    runner.procs._pump(io.BytesIO(f"token={PLANTED['HF_TOKEN']} key {PLANTED['MY_API_SECRET']}\n".encode()), stage_log)
    assert "***" in stage_log.getvalue() and not any(v in stage_log.getvalue() for v in PLANTED.values())
    (tmp_path / "run").mkdir()
    write_record(
        tmp_path / "run", RunRecord(error=f"failed with {PLANTED['HUGGING_FACE_HUB_TOKEN']}"), runner.secret_values
    )
    assert PLANTED["HUGGING_FACE_HUB_TOKEN"] not in (tmp_path / "run" / "run.json").read_text()
    rec = logging.LogRecord("quantpipe", logging.INFO, "x", 1, "using %s", (PLANTED["HF_TOKEN"],), None)
    _RedactFilter(secrets()).filter(rec)
    assert PLANTED["HF_TOKEN"] not in rec.getMessage()
    assert redact("no secret here") == "no secret here"


def test_no_byte_from_outside_an_input_folder_reaches_the_cache_or_a_package(tiny, tmp_path):
    """A copy of the tiny Llama whose chat template is a link to a file elsewhere on the host: `quantpipe run` exits 2
    naming the link, and the file's content is in no file under the output or cache directory (none is created)."""
    import shutil

    secret = tmp_path / "host" / "id_ed25519"
    secret.parent.mkdir()
    secret.write_text("PRIVATE-KEY-7f3a9c-not-for-packages\n")
    model = tmp_path / "llama"
    shutil.copytree(tiny.llama, model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    (model / "chat_template.jinja").symlink_to(secret)
    recipe = {
        "name": "links",
        "output_dir": str(tmp_path / "out"),
        "cache_dir": str(tmp_path / "cache"),
        "base": {"model": str(model), "dtype": "bfloat16"},
        "adapters": [{"path": str(tiny.llama_lora)}],
        "artifacts": [{"name": "fp8", "method": "fp8", "mode": "dynamic"}],
        "benchmark": {"enabled": False},
    }
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(recipe))
    r = subprocess.run([sys.executable, "-m", "quantpipe", "run", str(p)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stderr[-4000:]
    assert "base.model" in r.stderr and f"chat_template.jinja -> {secret}" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()
    for root, _, files in os.walk(tmp_path):
        for f in files:
            q = Path(root) / f
            if q != secret and not q.is_symlink():
                assert b"PRIVATE-KEY-7f3a9c" not in q.read_bytes(), f"{q} holds the linked file's content"


@pytest.mark.slow
def test_real_run_records_safety_switches_and_leaks_no_secret(tiny, tmp_path):
    """Tiny Llama + LoRA -> one FP8 artifact -> package (benchmark and evaluation off), with secrets in the environment:
    exit 0; the manifest and report record trust_remote_code false and allow_pickle true; the published package has no
    link out of the output directory; each stage's pre-flight estimate is at least its measured peak; and no file
    under the output or cache directory holds a planted secret."""
    recipe = {
        "name": "secure",
        "output_dir": str(tmp_path / "out"),
        "cache_dir": str(tmp_path / "cache"),
        "base": {"model": str(tiny.llama), "dtype": "bfloat16", "allow_pickle": True},
        "adapters": [{"path": str(tiny.llama_lora)}],
        "artifacts": [{"name": "fp8", "method": "fp8", "mode": "dynamic"}],
        "benchmark": {"enabled": False},
    }
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(recipe))
    env = {**os.environ, **PLANTED}
    r = subprocess.run(
        [sys.executable, "-m", "quantpipe", "run", str(p)], capture_output=True, text=True, timeout=1200, env=env
    )
    assert r.returncode == 0, r.stderr[-4000:]
    for v in PLANTED.values():
        assert v not in r.stdout and v not in r.stderr

    out = tmp_path / "out"
    pkg = out / "packages" / "fp8"
    manifest = json.loads((pkg / "manifest.json").read_text())
    assert manifest["trust_remote_code"] is False and manifest["allow_pickle"] is True
    assert "trust-remote-code" not in json.dumps(manifest["serve_command"])
    assert pkg.resolve().is_relative_to(out.resolve())
    for root, dirs, files in os.walk(pkg.resolve()):
        for f in dirs + files:
            q = Path(root) / f
            assert not q.is_symlink() or q.resolve().is_relative_to(out.resolve()), (
                f"{q} links out of the output directory"
            )

    run_dir = next((out / "runs").glob("2*"))
    report = json.loads((run_dir / "report.json").read_text())
    assert report["provenance"]["trust_remote_code"] is False and report["provenance"]["allow_pickle"] is True
    assert "trust_remote_code false" in (run_dir / "report.md").read_text()

    record = json.loads((run_dir / "run.json").read_text())
    assert record["available"]["ram_gib"] > 0
    for sid in ("merge", "quantize:fp8", "package:fp8"):
        st = record["stages"][sid]
        est, actual = st["preflight"]["estimate"], st["preflight"]["actual"]
        assert st["cache"] in ("miss", "forced") and actual["peak_rss_gib"] > 0, st
        assert est["ram_gib"] >= actual["peak_rss_gib"], (
            f"{sid}: estimate {est['ram_gib']} GiB < measured peak {actual['peak_rss_gib']} GiB"
        )

    leaks = []
    for top in (out, tmp_path / "cache"):
        for root, _, files in os.walk(top):
            for f in files:
                q = Path(root) / f
                if q.is_symlink():
                    continue
                data = q.read_bytes()
                leaks += [f"{q}: {k}" for k, v in PLANTED.items() if v.encode() in data]
    assert leaks == []
    assert sum(1 for _ in out.rglob("*")) > 10  # the walk saw the run: logs, run.json, report, package
