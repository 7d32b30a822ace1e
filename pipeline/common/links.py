"""Links that leave an input directory. A model or adapter folder cloned from a hub or a colleague may hold a symbolic
link (`tokenizer.json -> /home/me/.ssh/id_rsa`) that every reader follows: its target's bytes would be copied into the
stage cache and shipped in the package. quantpipe reads only what lies inside the folders a recipe names, so `check`
refuses such links and the merge stage, which is what reads those folders, refuses them again before it copies or links
anything. The Hugging Face cache's own layout is not an escape: a snapshot's files are links into the same repository's
`blobs/` folder.

    from quantpipe.common.links import escaping_links
    escaping_links(Path("models/llama"))   # -> [(Path("models/llama/tokenizer.json"), Path("/etc/passwd"))]
"""

from __future__ import annotations

import os
from pathlib import Path


def real_path(p: Path) -> Path:
    """The path with every link that exists resolved (a folder yet to be made resolves through its existing parents)."""
    try:
        return Path(os.path.realpath(p))
    except (OSError, ValueError):
        return Path(os.path.abspath(p))


def inside(p: Path, root: Path) -> bool:
    return p == root or root in p.parents


def allowed_roots(root: Path) -> list[Path]:
    """Where links in `root` may point: the folder itself, and for a hub-cache snapshot
    (`models--org--name/snapshots/<rev>`) its repository's `blobs/`."""
    real = real_path(root)
    roots = [real]
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        roots.append(real.parent.parent / "blobs")
    return roots


def escaping_links(root: Path) -> list[tuple[Path, Path]]:
    """(link, where it points) for every symbolic link under `root` (files and folders, hidden ones skipped as every
    reader skips them) whose target lies outside `root`; [] when `root` is not a folder."""
    root = Path(root)
    if not root.is_dir():
        return []
    roots = allowed_roots(root)
    out = []
    for dirpath, dirnames, filenames in os.walk(root):  # does not descend into linked folders: they are checked here
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in dirnames + sorted(f for f in filenames if not f.startswith(".")):
            p = Path(dirpath) / name
            if p.is_symlink():
                target = real_path(p)
                if not any(inside(target, r) for r in roots):
                    out.append((p, target))
    return out


def escape_sentence(field: str, root: Path, links: list[tuple[Path, Path]]) -> str:
    """The refusal of `links` in the folder a recipe field names, with the fix."""
    shown = "; ".join(f"{p.relative_to(root)} -> {t}" for p, t in links[:3]) + (
        f" (and {len(links) - 3} more)" if len(links) > 3 else ""
    )
    return (
        f"{field}: {root} holds links to files outside it ({shown}); quantpipe reads only files inside the folders a "
        "recipe names, so it would copy those files into the stage cache and the package: replace each link with a "
        "copy of the file if you mean to ship it (cp --remove-destination TARGET LINK), else delete it"
    )
