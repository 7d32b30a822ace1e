"""The stage environments' set-up: which lock a platform builds, the CUDA set-up path, and the CUDA locks themselves.

The CUDA path of scripts/setup_envs.sh runs here for real on stand-ins that install nothing heavy: a fake
`nvidia-smi` on PATH, a "host" interpreter whose site-packages holds a metadata-only torch, a lock of that torch
plus one small wheel, and a wheelhouse holding only that wheel. The locks' resolution for Linux x86_64 and
CPython 3.12 is checked against the index without installing anything (skipped where the index is unreachable).

    .venv/quantize/bin/python -m pytest -q tests/test_envs.py
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from quantpipe import envs

REPO = Path(__file__).resolve().parents[1]
SETUP = REPO / "scripts" / "setup_envs.sh"
LOCKS = REPO / "scripts" / "envs"
PYVER = "%d.%d" % sys.version_info[:2]
sys.path.insert(0, str(REPO / "scripts"))
import locks  # noqa: E402  (scripts/locks.py: standard library only)

sys.path.pop(0)


def _pins(path: Path) -> dict[str, str]:
    return {locks.norm(n): v for n, (_, v) in locks.pins(path).items()}


# --- which lock quantpipe keys its stage cache on ---------------------------------------------------------------


@pytest.fixture
def fresh_envs(monkeypatch, tmp_path):
    """envs' caches cleared and its venv root in tmp_path, before and after."""
    monkeypatch.setenv("QUANTPIPE_VENVS", str(tmp_path / "venvs"))
    for env in envs.ENVS:
        monkeypatch.delenv(f"QUANTPIPE_PYTHON_{env.upper()}", raising=False)
    envs.host_platform.cache_clear()
    envs.lock_text.cache_clear()
    yield tmp_path / "venvs"
    envs.host_platform.cache_clear()
    envs.lock_text.cache_clear()


def test_lock_of_an_unbuilt_environment_follows_the_platform(fresh_envs, monkeypatch):
    monkeypatch.setenv("QUANTPIPE_PLATFORM", "cuda")
    assert envs.lock_path("serve") == LOCKS / "serve-cuda.lock"
    assert envs.lock_path("autoawq") == LOCKS / "autoawq.lock"  # the legacy environments have CPU locks only
    envs.host_platform.cache_clear()
    monkeypatch.setenv("QUANTPIPE_PLATFORM", "cpu")
    assert envs.lock_path("serve") == LOCKS / "serve.lock"


def test_stage_cache_keys_on_the_lock_the_environment_was_built_from(fresh_envs, monkeypatch):
    """A CUDA environment on a host that (now) says cpu still keys on its CUDA lock: setup_envs.sh records it."""
    monkeypatch.setenv("QUANTPIPE_PLATFORM", "cpu")
    (fresh_envs / "serve").mkdir(parents=True)
    (fresh_envs / "serve" / ".quantpipe-lock").write_text("serve-cuda.lock\n")
    text = (LOCKS / "serve-cuda.lock").read_text()
    assert envs.lock_text("serve") == text
    assert envs.lock_hash("serve") == hashlib.sha256(text.encode()).hexdigest()
    assert envs.versions("serve")["vllm"] == "0.26.0"
    assert envs.lock_hash("quantize") == hashlib.sha256((LOCKS / "quantize.lock").read_bytes()).hexdigest()


def test_platform_is_cuda_where_nvidia_smi_lists_a_gpu(fresh_envs, monkeypatch, tmp_path):
    monkeypatch.delenv("QUANTPIPE_PLATFORM", raising=False)
    bin_ = _fake_nvidia_smi(tmp_path / "bin", gpus=1)
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")
    assert envs.host_platform() == "cuda"
    envs.host_platform.cache_clear()
    _fake_nvidia_smi(tmp_path / "bin", gpus=0)
    assert envs.host_platform() == "cpu"


# --- the CUDA locks -------------------------------------------------------------------------------------------------


def test_cuda_locks_pin_the_vllm_release_built_against_their_torch():
    serve, quantize = _pins(LOCKS / "serve-cuda.lock"), _pins(LOCKS / "quantize-cuda.lock")
    assert serve["vllm"] == "0.26.0" and serve["torch"] == quantize["torch"] == "2.11.0"
    assert serve["compressed-tensors"] == "0.17.0" and quantize["compressed-tensors"] == "0.19.0"
    assert quantize["llmcompressor"] == "0.14.0.1" and quantize["lm-eval"] == serve["lm-eval"] == "0.4.13"
    for lock in ("serve-cuda.lock", "quantize-cuda.lock"):
        assert locks.meta(LOCKS / lock, "python") == "3.12" and locks.meta(LOCKS / lock, "torch-cuda") == "13.0"
        body = [ln for ln in (LOCKS / lock).read_text().splitlines() if ln.strip() and not ln.startswith("#")]
        assert all(locks.PIN.match(ln) for ln in body), "every line of a lock is a name==version pin"
        assert len(body) == len(_pins(LOCKS / lock)), "no package is pinned twice"


def test_cuda_quantize_lock_holds_every_package_of_the_cpu_one():
    missing = set(_pins(LOCKS / "quantize.lock")) - set(_pins(LOCKS / "quantize-cuda.lock"))
    assert not missing, f"quantize-cuda.lock lacks {sorted(missing)}"


def test_a_pin_without_local_label_accepts_the_hosts_cuda_build():
    assert locks.satisfies("2.11.0+cu130", "2.11.0") and not locks.satisfies("2.11.0", "2.11.0+cpu")
    assert not locks.satisfies("2.10.0+cu130", "2.11.0")


def test_wheelhouse_for_a_host_leaves_out_what_its_freeze_has(tmp_path):
    lock = tmp_path / "x.lock"
    lock.write_text("# python: 3.12\ntorch==2.11.0\nnumpy==2.3.5\nvllm==0.26.0\n")
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("torch==2.11.0\nnumpy==2.5.2\n")
    assert locks.missing(lock, freeze) == ["numpy==2.3.5", "vllm==0.26.0"]


def _need_index() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "pip"], capture_output=True, text=True, timeout=120
    )
    if r.returncode != 0:
        pytest.skip(
            f"no package index reachable: pip index versions pip said {(r.stderr.strip().splitlines() or ['nothing'])[-1]}"
        )


def _python(version: str) -> str:
    """An interpreter of `version` with pip: pip evaluates markers such as `python_version > "3.11"` with the
    interpreter it runs under, whatever --python-version says, so a 3.12 lock is checked by a 3.12 pip."""
    import glob
    import shutil

    found = [
        shutil.which(f"python{version}"),
        *sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}*/bin/python{version}"))),
    ]
    for py in filter(None, found):
        r = subprocess.run(
            [py, "-c", "import sys, pip; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True
        )
        if r.returncode == 0 and r.stdout.strip() == version:
            return py
    pytest.skip(f"no python{version} with pip here to check a lock for CPython {version}")


@pytest.mark.long  # minutes of pip's resolver: a network check, run by `make test-long`
@pytest.mark.parametrize("lock", ["serve-cuda.lock", "quantize-cuda.lock"])
def test_cuda_lock_resolves_to_exactly_itself_for_linux_x86_64_cpython_312(lock, tmp_path):
    """pip's resolver, for the lock's target and not this machine, needs nothing the lock lacks and changes no pin:
    every pin has a wheel there (the no-wheel ones build here) and the set is consistent. Nothing is installed."""
    _need_index()
    path = LOCKS / lock
    py = _python(locks.meta(path, "python"))
    pinned = _pins(path)
    build = [f"{n}=={pinned[locks.norm(n)]}" for n in locks.meta(path, "no-wheel").split(",") if n]
    subprocess.run(
        [py, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "wheels"), *build], check=True, timeout=600
    )
    target = locks.target_args(locks.meta(path, "python"))
    report = tmp_path / "report.json"
    r = subprocess.run(
        [
            py,
            "-m",
            "pip",
            "install",
            "-q",
            "--dry-run",
            "--target",  # pip before 24 takes --platform with --target only; --dry-run installs nothing there
            str(tmp_path / "target"),
            *target,
            "--report",
            str(report),
            "--find-links",
            str(tmp_path / "wheels"),
            "-r",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = {
        locks.norm(i["metadata"]["name"]): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]
    }
    assert got == pinned


@pytest.mark.slow
def test_wheelhouse_holds_what_the_host_lacks_for_the_target_python(tmp_path):
    """scripts/wheelhouse.sh with a host freeze that has every serve pin but two: a 3.12 wheel of one, a wheel built
    here of the other (an sdist-only pin), nothing else."""
    _need_index()
    lock = LOCKS / "serve-cuda.lock"
    freeze = tmp_path / "freeze.txt"
    freeze.write_text(
        "".join(f"{n}=={v}\n" for n, (_, v) in locks.pins(lock).items() if n not in ("pyzmq", "rouge-score"))
    )
    r = subprocess.run(
        ["bash", str(REPO / "scripts" / "wheelhouse.sh"), "--have", str(freeze), str(tmp_path / "wh"), "serve"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    names = sorted(p.name for p in (tmp_path / "wh").iterdir())
    assert len(names) == 2 and names[0].startswith("pyzmq-27.3.0-cp312-") and "manylinux" in names[0], names
    assert names[1] == "rouge_score-0.1.2-py3-none-any.whl"


# --- scripts/setup_envs.sh on stand-ins ----------------------------------------------------------------------------


def _fake_nvidia_smi(bin_: Path, gpus: int) -> Path:
    """`nvidia-smi -L` and the `--query-gpu=index,memory.total,name` quantpipe asks, for `gpus` H200s."""
    bin_.mkdir(parents=True, exist_ok=True)
    listing = "".join(f"echo 'GPU {i}: NVIDIA H200 (UUID: GPU-{i})'\n" for i in range(gpus))
    query = "".join(f"echo '{i}, 143771, NVIDIA H200'\n" for i in range(gpus))
    (bin_ / "nvidia-smi").write_text(
        f'#!/bin/sh\ncase "$*" in\n*--query-gpu=index,memory.total,name*)\n{query};;\n-L)\n{listing};;\nesac\nexit 0\n'
    )
    (bin_ / "nvidia-smi").chmod(0o755)
    return bin_


def _wheel(dest: Path, name: str, version: str, code: str) -> Path:
    """A minimal pure-Python wheel (what pip needs: the module, METADATA, WHEEL, RECORD)."""
    dest.mkdir(parents=True, exist_ok=True)
    whl = dest / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr(f"{name}.py", code)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return whl


def _host(root: Path, torch_version: str, cuda: str | None) -> Path:
    """An interpreter whose site-packages has a torch that needs no GPU: its version module and metadata only."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = Path(
        subprocess.run(
            [str(root / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (site / "torch").mkdir()
    (site / "torch" / "version.py").write_text(f"__version__ = {torch_version!r}\ncuda = {cuda!r}\n")
    (site / "torch" / "__init__.py").write_text("from . import version\n__version__ = version.__version__\n")
    info = site / f"torch-{torch_version.split('+')[0]}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {torch_version.split('+')[0]}\n")
    (info / "RECORD").write_text("")
    return root / "bin" / "python"


@pytest.fixture
def cuda_host(tmp_path):
    """Stand-ins of a CUDA host: its nvidia-smi, a lock dir with serve-cuda.lock (torch 2.11.0 + `tinypkg`), a
    wheelhouse with tinypkg only. Returns a runner of setup_envs.sh for a host interpreter made by `_host`."""
    bin_ = _fake_nvidia_smi(tmp_path / "bin", gpus=1)
    locks_dir = tmp_path / "locks"
    locks_dir.mkdir()
    (locks_dir / "serve-cuda.lock").write_text(f"# python: {PYVER}\n# torch-cuda: 13.0\ntinypkg==1.0\ntorch==2.11.0\n")
    _wheel(tmp_path / "wheels", "tinypkg", "1.0", "WHERE = __file__\n")

    def setup(python: Path, *args: str, **extra: str) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("QUANTPIPE_", "PIP_"))}
        env.update(
            PATH=f"{bin_}{os.pathsep}{env['PATH']}",
            PYTHON=str(python),
            QUANTPIPE_HOME=str(tmp_path / "home"),
            QUANTPIPE_VENVS=str(tmp_path / "venvs"),
            QUANTPIPE_LOCKS=str(locks_dir),
            QUANTPIPE_WHEELHOUSE=str(tmp_path / "wheels"),
            PIP_CONFIG_FILE=os.devnull,
        )
        env.update(extra)
        return subprocess.run(
            ["bash", str(SETUP), *(args or ("serve",))], capture_output=True, text=True, env=env, timeout=300
        )

    return setup


@pytest.mark.slow
def test_setup_on_a_cuda_host_reuses_its_torch_and_installs_the_rest_from_the_wheelhouse(cuda_host, tmp_path):
    host_py = _host(tmp_path / "host", "2.11.0+cu130", "13.0")
    r = cuda_host(host_py)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "platform cuda (nvidia-smi lists 1 GPU(s))" in r.stdout
    assert "1 of 2 pins to install" in r.stdout
    serve = tmp_path / "venvs" / "serve"
    assert serve.resolve().parent == tmp_path / "home" / "envs" and serve.resolve().name.startswith("serve-cuda-")
    assert (serve / ".quantpipe-lock").read_text().strip() == "serve-cuda.lock"
    probe = "import json, torch, tinypkg; print(json.dumps([torch.__file__, torch.__version__, tinypkg.WHERE]))"
    torch_file, version, tiny_file = json.loads(
        subprocess.run([str(serve / "bin" / "python"), "-c", probe], capture_output=True, text=True, check=True).stdout
    )
    assert torch_file.startswith(str(tmp_path / "host")) and version == "2.11.0+cu130"  # the host's, not a copy
    assert Path(tiny_file).resolve().is_relative_to(serve.resolve())
    again = cuda_host(host_py)  # built once: a second set-up only re-links it
    assert again.returncode == 0 and "building" not in again.stdout


def test_setup_refuses_a_host_torch_other_than_the_locks_and_says_what_differs(cuda_host, tmp_path):
    r = cuda_host(_host(tmp_path / "host", "2.10.0+cu128", "12.8"))
    assert r.returncode == 2
    assert "torch 2.10.0+cu128 (CUDA 12.8)" in r.stderr and "pins torch==2.11.0 (CUDA 13.0)" in r.stderr
    assert "QUANTPIPE_HOST_TORCH=off" in r.stderr
    assert not (tmp_path / "home" / "envs").exists() and not (tmp_path / "venvs").exists()


@pytest.mark.slow
def test_setup_without_host_torch_needs_the_locks_torch_in_the_wheelhouse(cuda_host, tmp_path):
    """QUANTPIPE_HOST_TORCH=off (or no torch on the host): the lock's torch is installed, so an offline wheelhouse
    without it fails in pip, naming it (and nothing is linked)."""
    r = cuda_host(_host(tmp_path / "host", "2.11.0+cu130", "13.0"), QUANTPIPE_HOST_TORCH="off")
    assert r.returncode != 0 and "2 of 2 pins to install" in r.stdout
    assert re.search(r"torch==2\.11\.0", r.stderr)
    assert not (tmp_path / "venvs" / "serve").exists()


def test_setup_dry_run_detects_the_cuda_host_and_changes_nothing(cuda_host, tmp_path):
    r = cuda_host(_host(tmp_path / "host", "2.11.0+cu130", "13.0"), "--dry-run", "serve")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "platform cuda (nvidia-smi lists 1 GPU(s))" in r.stdout
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("==> serve:"))
    assert "serve-cuda.lock -> " in line and "(not built; a build installs 1 of its 2 pins" in line
    assert f"reusing the torch in {tmp_path / 'host'}" in line and "from " in line
    assert not (tmp_path / "home").exists() and not (tmp_path / "venvs").exists()


def test_setup_platform_override_and_bad_values(cuda_host, tmp_path):
    host_py = _host(tmp_path / "host", "2.11.0+cu130", "13.0")
    r = cuda_host(host_py, QUANTPIPE_PLATFORM="cpu")  # despite nvidia-smi: the CPU lock, which this lock dir lacks
    assert r.returncode == 2 and "platform cpu (QUANTPIPE_PLATFORM)" in r.stdout and "serve.lock" in r.stderr
    r = cuda_host(host_py, QUANTPIPE_PLATFORM="rocm")
    assert r.returncode == 2 and "use cpu or cuda" in r.stderr
    r = cuda_host(host_py, QUANTPIPE_WHEELHOUSE=str(tmp_path / "nowhere"))
    assert r.returncode == 2 and "is not a directory" in r.stderr


def test_setup_refuses_a_python_other_than_the_locks(cuda_host, tmp_path):
    lock = tmp_path / "locks" / "serve-cuda.lock"
    lock.write_text(lock.read_text().replace(f"# python: {PYVER}", "# python: 3.99"))
    r = cuda_host(_host(tmp_path / "host", "2.11.0+cu130", "13.0"))
    assert r.returncode == 2 and "resolved for CPython 3.99" in r.stderr and "PYTHON=python3.99" in r.stderr


# --- quantpipe doctor --------------------------------------------------------------------------------------------


def test_doctor_names_a_missing_environment_and_exits_1(monkeypatch, tmp_path):
    from click.testing import CliRunner

    from quantpipe.cli import main

    monkeypatch.setenv("QUANTPIPE_PLATFORM", "cpu")
    monkeypatch.setenv("QUANTPIPE_PYTHON_SERVE", str(tmp_path / "nowhere" / "python"))
    monkeypatch.setenv("QUANTPIPE_PYTHON_QUANTIZE", str(tmp_path / "nowhere" / "python"))
    envs.host_platform.cache_clear()
    envs.lock_text.cache_clear()
    r = CliRunner().invoke(main, ["doctor", "--no-vllm", "--json"])
    envs.lock_text.cache_clear()
    assert r.exit_code == 1
    rep = json.loads(r.stdout[: r.stdout.rindex("}") + 1])
    serve = next(e for e in rep["envs"] if e["env"] == "serve")
    assert rep["platform"] == "cpu" and serve["status"] == "fail" and "nowhere" in serve["detail"]
    assert "serve:" in r.stderr and "quantize:" in r.stderr and "make setup" in r.stderr


def test_doctor_refuses_an_unknown_platform_override(monkeypatch):
    from click.testing import CliRunner

    from quantpipe.cli import main

    monkeypatch.setenv("QUANTPIPE_PLATFORM", "rocm")
    envs.host_platform.cache_clear()
    r = CliRunner().invoke(main, ["doctor", "--no-vllm"])
    envs.host_platform.cache_clear()
    assert r.exit_code == 2 and "QUANTPIPE_PLATFORM=rocm is not a platform: use cpu or cuda" in r.stderr
    assert r.stdout == ""


@pytest.mark.slow
def test_doctor_on_a_gpu_host_lists_its_gpus_and_flags_cpu_builds(monkeypatch, tmp_path):
    """nvidia-smi lists an H200: doctor says cuda and why, shows the GPU and its memory, and marks environments
    built from the CPU locks; the same with CUDA_VISIBLE_DEVICES hiding it is a problem (exit 1)."""
    from click.testing import CliRunner

    from quantpipe.cli import main

    monkeypatch.delenv("QUANTPIPE_PLATFORM", raising=False)
    monkeypatch.delenv("QUANTPIPE_GPUS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    bin_ = _fake_nvidia_smi(tmp_path / "bin", gpus=1)
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")
    envs.host_platform.cache_clear()
    r = CliRunner().invoke(main, ["doctor", "--no-vllm", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout[: r.stdout.rindex("}") + 1])
    assert rep["platform"] == "cuda" and rep["platform_why"] == "nvidia-smi lists a GPU"
    assert rep["gpus"] == [{"index": "0", "name": "NVIDIA H200", "memory_gib": 140.4}]
    for e in rep["envs"]:
        cpu_build = envs.lock_path(e["env"]).name == f"{e['env']}.lock"
        assert (e["status"] == "warn" and f"{e['env']}-cuda.lock" in e["note"]) if cpu_build else e["status"] == "ok"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    r = CliRunner().invoke(main, ["doctor", "--no-vllm"])
    envs.host_platform.cache_clear()
    assert r.exit_code == 1 and "the platform is cuda (nvidia-smi lists a GPU) but no GPU is listed" in r.stderr


@pytest.mark.slow
def test_doctor_probe_in_the_serve_env_follows_vllms_kernels_and_capabilities():
    """probe() on this CPU (what vLLM's CPU build serves follows the kernels it loaded), and the GPU verdicts from
    vLLM's own scheme classes for an A100 (8.0) and an H100/H200 (9.0): W8A8-FP8 only from 8.9, FP8 weight-only below."""
    pkg = envs.PACKAGE_DIR
    r = subprocess.run(
        [
            str(envs.python_for("serve")),
            str(Path(__file__).parent / "helpers" / "doctor_probe.py"),
            str(pkg / "__init__.py"),
            str(pkg),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")).split(" ", 1)[1])
    probe, gpu = out["probe"], out["gpu"]
    assert probe["platform"]["platform"] == "cpu" and probe["cuda_devices"] == 0
    rows = {row["scheme"]: row["verdict"] for row in probe["schemes"]}
    assert rows["BF16"] == rows["FP8 W8A8"] == rows["INT8 W8A8"] == "yes" and rows["W8A16"] == "no"
    assert rows["W4A16"] == ("yes" if probe["platform"]["kernels"]["cpu_gemm_wna16"] else "no")
    assert gpu["80"]["FP8 W8A8"] == "weight-only" and gpu["90"]["FP8 W8A8"] == "yes"
    assert gpu["80"]["INT8 W8A8"] == gpu["80"]["W4A16"] == gpu["90"]["W4A16"] == "yes"
