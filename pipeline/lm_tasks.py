"""Do the recipe's lm-eval tasks exist? Asked of lm-eval's own task files and YAML loader, in about a second, before anything runs.

Both stage environments pin the lm_eval of this CLI's environment (scripts/envs/*.lock), so the names found here are the
ones the evaluate stage finds. lm-eval's full index parses ~14,000 YAML files (~11 s on 2 cores) and `import lm_eval.tasks`
imports datasets and pandas (~2 s), so the include_path is indexed with lm-eval's YAML loader (functions never imported)
under TaskIndex's rule (`lm_eval/tasks/_index.py`, mirrored for the versions in MIRRORED and tested against it), another
name is looked for only in the built-in task files whose text names it, and lm-eval's full TaskManager is built only when
that cannot decide. Unknown names come with the nearest ones. A task file of the include_path that runs Python (`!function`,
`class:`) is refused unless the recipe sets `evaluation.lm_eval.trust_task_code` (lm-eval's built-in tasks are trusted):

    from quantpipe.lm_tasks import problems
    problems(recipe)   # -> ["evaluation.lm_eval.tasks: unknown task 'tiny_fact_mc' (did you mean 'tiny_facts_mc'?); ..."]
"""

from __future__ import annotations

import difflib
import functools
import importlib.metadata
import importlib.util
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)
MIRRORED = ("0.4.13",)  # lm-eval versions whose TaskIndex rule `_register` follows (tests/test_refuse.py compares them)
IGNORE_DIRS = {"__pycache__", ".ipynb_checkpoints"}
TOKEN = re.compile(rb"[\w.-]+")
NAME_LINE = re.compile(r"^\s*(?:task|group|tag)\s*:\s*['\"]?([\w\-.]+)", re.M)  # for suggestions only


@dataclass
class Entry:
    kind: str  # TASK, PY_TASK, GROUP or TAG, as lm-eval's Kind
    cfg: dict | None = None
    tags: set = field(default_factory=set)  # a tag's tasks


def _register(cfg: dict, index: dict) -> None:
    """What one task YAML defines, as lm-eval's TaskIndex.process_cfg registers it (the first of a name wins)."""
    kind = "PY_TASK" if "class" in cfg else "GROUP" if "group" in cfg else "TASK" if "task" in cfg else None
    if kind is None:
        raise ValueError(f"unknown config shape: keys={list(cfg)}")
    name = cfg["group"] if kind == "GROUP" else cfg["task"]
    if name in index:
        return
    index[name] = Entry(kind, cfg)
    tags = cfg.get("tag") if kind != "GROUP" else None
    for tag in (tags if isinstance(tags, list) else [tags]) if tags else []:
        index.setdefault(tag, Entry("TAG")).tags.add(name)


def _yaml_files(root: Path) -> list[Path]:
    return sorted(
        (p for p in root.glob("**/*.yaml") if not any(part in IGNORE_DIRS for part in p.parts)),
        key=lambda p: p.as_posix(),
    )


def light_index(files, load_yaml) -> dict[str, Entry]:
    """{name: Entry} of tasks, groups and tags defined in these YAML files (lm-eval skips a file it cannot read; so do we)."""
    index: dict[str, Entry] = {}
    for f in files:
        try:
            _register(load_yaml(Path(f), resolve_func=False, recursive=True), index)
        except Exception as e:  # noqa: BLE001 - as TaskIndex.build: any unreadable file is skipped
            log.debug("skip %s (%s)", f, e)
    return index


@functools.lru_cache(maxsize=2)
def _task_file_texts(root: str) -> dict[str, bytes]:
    """{path: bytes} of lm-eval's built-in task YAMLs (read once per process: ~14,000 files)."""
    texts: dict[str, bytes] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in IGNORE_DIRS)
        for f in filenames:
            if f.endswith(".yaml"):
                p = os.path.join(dirpath, f)
                try:
                    with open(p, "rb") as fh:
                        texts[p] = fh.read()
                except OSError:
                    continue
    return texts


@functools.lru_cache(maxsize=2)
def _task_file_tokens(root: str) -> frozenset[bytes]:
    """Every maximal run of word characters, dots and dashes in lm-eval's built-in task YAMLs: any other name is in no file."""
    return frozenset(tok for t in _task_file_texts(root).values() for tok in TOKEN.findall(t))


@functools.lru_cache(maxsize=2)
def _task_file_names(root: str) -> frozenset[str]:
    """The task, group and tag names written out in lm-eval's built-in task YAMLs (for suggestions)."""
    return frozenset(
        n for t in _task_file_texts(root).values() for n in NAME_LINE.findall(t.decode("utf-8", "replace"))
    )


def _lm_eval_yaml_loader():
    """lm-eval's task-YAML loader module, loaded from its file so that lm_eval.tasks (and datasets) is not imported."""
    spec = importlib.util.find_spec("lm_eval")  # a top-level package: found, not imported
    path = Path(spec.origin).parent / "tasks" / "_yaml_loader.py"
    s = importlib.util.spec_from_file_location("quantpipe._lm_eval_yaml_loader", path)
    mod = importlib.util.module_from_spec(s)
    s.loader.exec_module(mod)
    return mod


class TaskNames:
    """The names lm-eval knows (tasks, groups, tags), indexed as lazily as the recipe allows."""

    def __init__(self, include_path: str | None):
        spec = importlib.util.find_spec("lm_eval")
        if spec is None:
            raise ImportError("lm_eval is not installed")
        self.defaults = Path(spec.origin).parent / "tasks"
        self.include_path = include_path
        self.light = importlib.metadata.version("lm_eval") in MIRRORED
        self._full = False
        if not self.light:
            self._full_index(include_defaults=False)
            self._full = False
            return
        self.load_yaml = _lm_eval_yaml_loader().load_yaml
        self.index = light_index(_yaml_files(Path(include_path)), self.load_yaml) if include_path else {}

    def _full_index(self, include_defaults: bool = True) -> None:
        from lm_eval.tasks import TaskManager

        tm = TaskManager(include_path=self.include_path, include_defaults=include_defaults)
        self.index = {k: Entry(e.kind.name, e.cfg, set(e.tags)) for k, e in tm.task_index.items()}
        self._full = include_defaults

    def _default_texts(self) -> dict[str, bytes]:
        return _task_file_texts(str(self.defaults))

    def known(self, name: str) -> bool:
        if name in self.index:
            return True
        if self._full:
            return False
        if self.light:
            word = name.encode()
            if TOKEN.fullmatch(word) and word not in _task_file_tokens(str(self.defaults)):
                return False
            token = re.compile(rb"(?<![\w.-])" + re.escape(word) + rb"(?![\w.-])")
            files = [p for p, t in self._default_texts().items() if token.search(t)]
            if not files:
                return False  # every name lm-eval registers is written out in some task YAML
            found = light_index(sorted(files, key=lambda p: Path(p).as_posix()), self.load_yaml)
            self.index = {**found, **self.index}  # include_path wins, as in lm-eval
            if name in self.index:
                return True
        self._full_index()  # e.g. a tag set in an included template: only the full index can tell
        return name in self.index

    def suggestions(self, name: str) -> list[str]:
        names = set(self.index) | _task_file_names(str(self.defaults))
        return difflib.get_close_matches(name, sorted(names), 3)

    def leaves(self, name: str, depth: int = 0) -> set[str] | None:
        """The name and every task or group below it (what lm-eval reports results under); None when not all known."""
        e = self.index.get(name)
        if e is None or depth > 8:
            return None
        if e.kind == "TAG":
            children = sorted(e.tags)
        elif e.kind == "GROUP":
            raw = (e.cfg or {}).get("task") or []
            children = [
                c if isinstance(c, str) else (c.get("task") or c.get("group")) if isinstance(c, dict) else None
                for c in (raw if isinstance(raw, list) else [raw])
            ]
        else:
            return {name}
        out = {name}
        for c in children:
            sub = self.leaves(c, depth + 1) if isinstance(c, str) and self.known(c) else None
            if sub is None:
                return None
            out |= sub
        return out


def _local_data_files(entry: Entry | None) -> list[str]:
    """The absolute local paths a task reads its data from (dataset_path, dataset_kwargs.data_files); hub ids and URLs are not paths."""
    cfg = (entry.cfg or {}) if entry else {}
    kwargs = cfg.get("dataset_kwargs")
    files = kwargs.get("data_files") if isinstance(kwargs, dict) else None
    found = [cfg.get("dataset_path")]
    for v in files.values() if isinstance(files, dict) else [files]:
        found.extend(v if isinstance(v, list) else [v])
    return [f for f in found if isinstance(f, str) and f.startswith("/") and not any(c in f for c in "*?[")]


def local_documents(le) -> int | None:
    """How many documents the recipe's lm-eval tasks hold, where every task reads local files (JSON lines, one document
    a line); None where any reads a hub dataset, or lm-eval is not here (not counted before the run loads it)."""
    try:
        names = TaskNames(le.include_path)
    except Exception:  # noqa: BLE001 - no lm-eval, a folder it cannot index: not counted
        return None
    total = 0
    for t in le.tasks:
        if not names.known(t):
            return None
        for leaf in sorted(names.leaves(t) or {t}):
            e = names.index.get(leaf)
            if e is None or e.kind in ("GROUP", "TAG"):
                continue
            files = _local_data_files(e)
            if e.kind != "TASK" or not files:
                return None
            docs = 0
            for f in files:
                try:
                    with open(f, "rb") as fh:
                        docs += sum(1 for _ in fh)
                except OSError:
                    return None
            total += min(docs, le.limit) if le.limit else docs
    return total


def task_code(include_path: str | Path) -> list[str]:
    """`file: what` for each task YAML under include_path that runs Python when lm-eval loads it: a `!function` tag
    (lm-eval imports the named module from the task's folder) or a `class:` key (a task implemented in Python). Read as
    YAML nodes, never constructed, so nothing is imported; a file lm-eval could not read is skipped, as lm-eval skips it."""
    import yaml

    root, found = Path(include_path), []
    for f in _yaml_files(root):
        try:
            docs = list(yaml.compose_all(f.read_text(encoding="utf-8"), Loader=yaml.SafeLoader))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue
        what = set()
        seen: set[int] = set()
        stack = [d for d in docs if d is not None]
        for d in stack:
            if isinstance(d, yaml.MappingNode) and any(k.value == "class" for k, _ in d.value):
                what.add("class:")
        while stack:
            node = stack.pop()
            if id(node) in seen:  # an alias repeats a node: visit it once
                continue
            seen.add(id(node))
            if node.tag == "!function":
                what.add("!function")
            if isinstance(node, yaml.MappingNode):
                stack += [n for kv in node.value for n in kv]
            elif isinstance(node, yaml.SequenceNode):
                stack += node.value
        if what:
            found.append(f"{f.relative_to(root)}: {' and '.join(sorted(what))}")
    return found


def code_problems(le) -> list[str]:
    """include_path tasks that would run Python, refused unless the recipe trusts them (trust_task_code)."""
    if not le.include_path or le.trust_task_code:
        return []
    code = task_code(le.include_path)
    if not code:
        return []
    shown = "; ".join(code[:5]) + (f" (and {len(code) - 5} more files)" if len(code) > 5 else "")
    return [
        f"evaluation.lm_eval.include_path: {le.include_path} holds task files that run Python code when lm-eval loads "
        f"them ({shown}); every evaluate stage would import and run that code: set evaluation.lm_eval.trust_task_code: "
        "true if you trust the folder, else remove those tasks from it"
    ]


def problems(recipe) -> list[str]:
    """Unknown task names (with the nearest ones), task data files that do not exist, per-task gates naming no evaluated
    task, task code the recipe does not trust."""
    le = recipe.evaluation.lm_eval
    if le is None:
        return []
    code = code_problems(le)
    if code:
        return code
    try:
        names = TaskNames(le.include_path)
    except ImportError:  # a CLI installed without lm-eval: the evaluate stage checks the names itself
        return []
    except Exception as e:  # noqa: BLE001 - a task folder lm-eval cannot index at all
        return [
            f"evaluation.lm_eval.include_path: lm-eval cannot index {le.include_path} ({type(e).__name__}: {e}); fix the task files"
        ]
    out = []
    unknown = [t for t in le.tasks if not names.known(t)]
    if unknown:
        hints = []
        for t in unknown:
            close = names.suggestions(t)
            hints.append(f"{t!r}" + (f" (did you mean {', '.join(map(repr, close))}?)" if close else ""))
        where = (
            f"evaluation.lm_eval.include_path ({le.include_path})"
            if le.include_path
            else "evaluation.lm_eval.include_path (not set)"
        )
        out.append(
            f"evaluation.lm_eval.tasks: unknown task {', '.join(hints)}; lm-eval knows its built-in tasks and the YAML "
            f"files in {where}: fix the name or add the task's YAML there"
        )
        return out
    missing = [
        (leaf, f)
        for t in le.tasks
        for leaf in sorted(names.leaves(t) or {t})
        for f in _local_data_files(names.index.get(leaf))
        if not Path(f).exists()
    ]
    if missing:
        out.append(
            "evaluation.lm_eval.tasks: "
            + "; ".join(f"task {leaf!r} reads its data from {f}, which does not exist" for leaf, f in missing)
            + ": fix dataset_path / dataset_kwargs.data_files in the task's YAML (a copied task folder keeps the old absolute paths)"
        )
        return out
    per_task = recipe.evaluation.gates.min_recovery_per_task
    if per_task:
        allowed: set[str] | None = {"validation"} if recipe.evaluation.validation else set()
        for t in le.tasks:
            sub = names.leaves(t)
            allowed = None if sub is None or allowed is None else allowed | sub
        stray = sorted(set(per_task) - allowed) if allowed is not None else []
        if stray:
            close = {s: difflib.get_close_matches(s, sorted(allowed), 1) for s in stray}
            out.append(
                "evaluation.gates.min_recovery_per_task: "
                + ", ".join(f"{s!r}" + (f" (did you mean {close[s][0]!r}?)" if close[s] else "") for s in stray)
                + f" is not among the evaluated tasks ({', '.join(sorted(allowed))}); the gate would fail every artifact: fix the name"
            )
    return out
