"""Read quantpipe's lock files (scripts/envs/*.lock) for scripts/setup_envs.sh and scripts/wheelhouse.sh.

Standard library only: it runs under whatever interpreter builds an environment, before anything is installed.

    python3 scripts/locks.py meta scripts/envs/serve-cuda.lock python        # "3.12" (a `# python: 3.12` header line)
    python3 scripts/locks.py missing scripts/envs/serve-cuda.lock            # pins this interpreter does not see installed
    python3 scripts/locks.py missing LOCK --have host-freeze.txt              # pins a host with that `pip freeze` lacks
    python3 scripts/locks.py host-torch scripts/envs/serve-cuda.lock         # the visible torch's site dir, if it is the lock's
    python3 scripts/locks.py pip-check scripts/envs/serve-cuda.lock          # `pip check`, limited to the lock's packages
    python3.12 scripts/locks.py resolve --prefer FREEZE REQ...               # pins for a CUDA lock (see its header)

A lock is a full list of `name==version` pins installed with --no-deps; `# key: value` lines at its top describe it
(`python`, the CPython it was resolved for; `torch-cuda`, the CUDA release of its torch build).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(lock: Path) -> dict[str, tuple[str, str]]:
    """normalized name -> (the line's name, version)."""
    out = {}
    for line in lock.read_text().splitlines():
        m = PIN.match(line.strip())
        if m:
            out[norm(m.group(1))] = (m.group(1), m.group(2))
    return out


def meta(lock: Path, key: str) -> str:
    for line in lock.read_text().splitlines():
        m = re.match(rf"^#\s*{re.escape(key)}:\s*(\S+)", line)
        if m:
            return m.group(1)
    return ""


def satisfies(installed: str, pin: str) -> bool:
    """PEP 440 `==pin` for the versions locks hold: a pin without a local label accepts any (2.11.0 ~ 2.11.0+cu130)."""
    return installed == pin or ("+" not in pin and installed.split("+")[0] == pin)


def installed_versions() -> dict[str, tuple[str, str]]:
    """normalized name -> (version, location) of what this interpreter imports first (sys.path order)."""
    seen: dict[str, tuple[str, str]] = {}
    for d in md.distributions():
        name = d.metadata["Name"]
        if name and norm(name) not in seen:
            seen[norm(name)] = (d.version, str(d.locate_file("")))
    return seen


def freeze_versions(path: Path) -> dict[str, tuple[str, str]]:
    return {norm(n): (v, str(path)) for n, (_, v) in pins(path).items()}


def missing(lock: Path, have: Path | None = None) -> list[str]:
    """The lock's pins that are not installed at their version (here, or on the host whose freeze `have` is)."""
    present = freeze_versions(have) if have else installed_versions()
    return [
        f"{name}=={v}"
        for key, (name, v) in pins(lock).items()
        if not (key in present and satisfies(present[key][0], v))
    ]


def torch_here() -> dict | None:
    """The torch this interpreter would import: version, CUDA release and site dir, read without importing it."""
    try:
        dist = md.distribution("torch")
    except md.PackageNotFoundError:
        return None
    site = Path(str(dist.locate_file("")))
    info = {"version": dist.version, "site": str(site), "cuda": None}
    try:  # torch/version.py is self-contained: cuda = '13.0' (None in a CPU build)
        scope: dict = {}
        exec(compile((site / "torch" / "version.py").read_text(), "torch/version.py", "exec"), scope)
        info["version"] = scope.get("__version__", info["version"])
        info["cuda"] = scope.get("cuda")
    except (OSError, SyntaxError):
        pass
    return info


def host_torch(lock: Path) -> int:
    """Print the site dir of the torch this interpreter has when it is the lock's build (exit 0); exit 3 when there is
    none; exit 2 with a sentence saying what differs otherwise."""
    t = torch_here()
    if t is None:
        return 3
    want = pins(lock).get("torch", ("torch", ""))[1]
    want_cuda = meta(lock, "torch-cuda") or None
    if satisfies(t["version"], want) and (want_cuda is None or t["cuda"] == want_cuda):
        print(t["site"])
        return 0
    have = f"torch {t['version']} ({'CUDA ' + t['cuda'] if t['cuda'] else 'no CUDA'}) in {t['site']}"
    print(
        f"{sys.executable} has {have}, but {lock} pins torch=={want}"
        + (f" (CUDA {want_cuda})" if want_cuda else "")
        + ". Reusing it would mix two torch builds. Either run with PYTHON=<a python whose torch is the lock's>, or set "
        "QUANTPIPE_HOST_TORCH=off to install the lock's torch into the environment (several GB, from the index or "
        "QUANTPIPE_WHEELHOUSE).",
        file=sys.stderr,
    )
    return 2


def pip_check(lock: Path, ignore: str | None) -> int:
    """`pip check`, keeping only problems of the lock's own packages: an environment that reuses a host's site dir
    also sees that host's other packages, whose requirements are not this environment's business."""
    names = set(pins(lock))
    r = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    problems = []
    for line in (r.stdout + r.stderr).splitlines():
        words = line.split()
        if not words or line.startswith("No broken requirements") or norm(words[0]) not in names:
            continue
        if ignore and re.search(ignore, line):
            continue
        problems.append(line)
    if problems:
        print(f"pip check failed for {lock.name}:", *problems, sep="\n", file=sys.stderr)
        return 1
    return 0


def target_args(python: str) -> list[str]:
    """pip options that select wheels for CPython `python` on Linux x86_64 with glibc >= 2.17, not for this machine."""
    plats = ["any", "linux_x86_64", "manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64"]
    plats += [f"manylinux_2_{n}_x86_64" for n in range(17, 40)]
    abi = "cp" + python.replace(".", "")
    return [
        "--only-binary=:all:",
        "--python-version",
        python,
        "--implementation",
        "cp",
        "--abi",
        abi,
        "--abi",
        "abi3",
        "--abi",
        "none",
        *(a for p in plats for a in ("--platform", p)),
    ]


def resolve(reqs: list[str], prefer: list[Path], python: str, build: list[str]) -> list[str]:
    """A full, consistent set of pins for `reqs` on the target, by pip's resolver (nothing installed). Versions in the
    `prefer` files (the first that names a package wins) are constraints; one that pip says conflicts is dropped and
    the resolution retried. `build`: pins without wheels, built here (pure-Python sdists) and offered to pip."""
    here = "%d.%d" % sys.version_info[:2]
    if python != here:
        raise SystemExit(
            f"run this with python{python}, not {here}: pip evaluates environment markers (such as "
            f'python_version > "3.11") with the interpreter it runs under, whatever --python-version says'
        )
    fixed = {norm(PIN.match(r).group(1)) for r in reqs if PIN.match(r)}
    pref: dict[str, str] = {}
    for f in prefer:
        for key, (name, v) in pins(f).items():
            if key not in pref and key not in fixed:
                pref[key] = f"{name}=={v}"
    with tempfile.TemporaryDirectory() as tmp:
        wheels = Path(tmp) / "wheels"
        if build:
            subprocess.run(
                [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), *build], check=True
            )
        for _ in range(50):
            (Path(tmp) / "prefer.txt").write_text("".join(v + "\n" for v in pref.values()))
            r = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "install",
                    "--dry-run",
                    "--target",  # pip before 24 takes --platform with --target only; --dry-run installs nothing
                    f"{tmp}/target",
                    *target_args(python),
                    "--report",
                    f"{tmp}/report.json",
                    "-c",
                    f"{tmp}/prefer.txt",
                    "--find-links",
                    str(wheels),
                    *reqs,
                ],
                capture_output=True,
                text=True,
            )
            if r.returncode == 0:
                report = json.loads(Path(f"{tmp}/report.json").read_text())
                got = sorted((i["metadata"]["name"], i["metadata"]["version"]) for i in report["install"])
                return [f"{n}=={v}" for n, v in sorted(got, key=lambda p: p[0].lower())]
            out = r.stdout + r.stderr
            drop = {norm(n) for n in re.findall(r"requested \(constraint\) ([A-Za-z0-9_.-]+)", out)}
            drop |= {
                norm(n)
                for n, v in re.findall(r"^\s+([A-Za-z0-9_.-]+) (\S+) depends on", out, re.M)
                if pref.get(norm(n), "").endswith(f"=={v}")
            }
            drop &= set(pref)
            if not drop:
                raise SystemExit(f"pip found no resolution, and no preferred version is to blame:\n{out[-3000:]}")
            for key in sorted(drop):
                print(f"dropped the preference {pref.pop(key)}", file=sys.stderr)
    raise SystemExit("no resolution after 50 tries")


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    cmd, lock = argv[0], Path(argv[1])
    if cmd == "resolve":
        opts: dict[str, list[str]] = {"--prefer": [], "--python": [], "--build": []}
        reqs, rest = [], iter(argv[1:])
        for a in rest:
            if a in opts:
                opts[a].append(next(rest))
            else:
                reqs.append(a)
        print(
            "\n".join(
                resolve(
                    reqs,
                    [Path(p) for p in opts["--prefer"]],
                    (opts["--python"] or ["%d.%d" % sys.version_info[:2]])[-1],
                    opts["--build"],
                )
            )
        )
    elif cmd == "names":
        print(" ".join(name for name, _ in pins(lock).values()))
    elif cmd == "meta":
        print(meta(lock, argv[2]))
    elif cmd == "pin":
        print(pins(lock).get(norm(argv[2]), ("", ""))[1])
    elif cmd == "missing":
        have = Path(argv[argv.index("--have") + 1]) if "--have" in argv else None
        print("\n".join(missing(lock, have)))
    elif cmd == "host-torch":
        return host_torch(lock)
    elif cmd == "pip-check":
        return pip_check(lock, argv[argv.index("--ignore") + 1] if "--ignore" in argv else None)
    elif cmd == "torch-json":
        print(json.dumps(torch_here()))
    else:
        print(f"unknown command {cmd!r}; see the header of {__file__}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
