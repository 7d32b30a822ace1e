#!/usr/bin/env python
"""Print docs/recipes.md, the recipe reference, from the pydantic models of `quantpipe.recipe`.

One section per model (the top level, base, adapters, calibration, each artifact method, evaluation,
benchmark, package and what they nest), each a table of field, type, default and description taken
from the models' `model_fields`, so the reference says what `quantpipe check` enforces. `--check`
compares the file with what the schema gives and exits 1 when they differ (tests/test_docs.py does
the same in-process):

    .venv/quantize/bin/python scripts/recipe_docs.py > docs/recipes.md
    .venv/quantize/bin/python scripts/recipe_docs.py --check
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
import types
import typing
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "recipes.md"
COMMAND = "scripts/recipe_docs.py > docs/recipes.md"


def _import_quantpipe():
    """This checkout's quantpipe (pipeline/ under the import name quantpipe), installed or not."""
    pkg = REPO / "pipeline"
    mod = sys.modules.get("quantpipe")
    if mod is None:
        try:
            import quantpipe as mod
        except ImportError:
            mod = None
    if mod is None or Path(mod.__file__).resolve().parent != pkg:  # as pipeline/worker.py bootstraps it
        spec = importlib.util.spec_from_file_location(
            "quantpipe", pkg / "__init__.py", submodule_search_locations=[str(pkg)]
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules["quantpipe"] = mod
        spec.loader.exec_module(mod)
    return mod


def _slug(title: str) -> str:
    """The anchor GitHub gives a heading."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


class Reference:
    """Walks the Recipe model depth-first, one section per model, in field order."""

    def __init__(self, root):
        from pydantic import BaseModel

        self.BaseModel = BaseModel
        self.sections: list[tuple[str, type, str | None]] = []  # (title, model, its tag field when a union member)
        self.title_of: dict[type, str] = {}
        self._visit(root, "recipe (top level)", None)

    # --- walking --------------------------------------------------------------------------------

    def _is_model(self, t) -> bool:
        return isinstance(t, type) and issubclass(t, self.BaseModel)

    def _visit(self, model, title: str, tag: str | None) -> None:
        if model in self.title_of:
            return
        self.title_of[model] = title
        self.sections.append((title, model, tag))
        prefix = "" if model is self.sections[0][1] else title.split(" ")[0]
        for name, f in model.model_fields.items():
            path = f"{prefix}.{name}" if prefix else name
            for child, where, tag in self._children(f.annotation, path):
                self._visit(child, where, tag)

    def _children(self, ann, path: str):
        """(model, section title, tag field or None) for every model the annotation holds."""
        origin, args = typing.get_origin(ann), typing.get_args(ann)
        tag = self._discriminator(ann)
        if origin is typing.Annotated and tag:
            for a in typing.get_args(args[0]):
                value = typing.get_args(a.model_fields[tag].annotation)[0]
                yield a, f"{path} ({tag}: {value})", tag
        elif origin is typing.Annotated:
            yield from self._children(args[0], path)
        elif self._is_model(ann):
            yield ann, path, ""
        elif origin in (list, tuple, set, frozenset):
            for a in args:
                yield from self._children(a, path + "[]")
        elif origin is dict:
            yield from self._children(args[-1], path + "{}")
        elif origin in (typing.Union, types.UnionType):
            for a in args:
                yield from self._children(a, path)

    def _discriminator(self, ann) -> str | None:
        """The tag field of a discriminated union (Annotated[Union[...], Field(discriminator=...)])."""
        for m in getattr(ann, "__metadata__", ()):
            if getattr(m, "discriminator", None):
                return m.discriminator
        return None

    # --- rendering ------------------------------------------------------------------------------

    def link(self, model, text: str | None = None) -> str:
        title = self.title_of[model]
        return f"[{text or title.removesuffix(' (top level)')}](#{_slug(title)})"

    def type_str(self, ann, discriminator: str | None = None) -> str:
        origin, args = typing.get_origin(ann), typing.get_args(ann)
        if origin is typing.Annotated:
            return self.type_str(args[0], self._discriminator(ann) or discriminator)
        if ann is type(None):
            return "null"
        if self._is_model(ann):
            return self.link(ann)
        if origin is typing.Literal:
            vals = [f"`{json.dumps(v)}`" for v in args]
            return vals[0] if len(vals) == 1 else "one of " + ", ".join(vals)
        if origin in (list, tuple, set, frozenset):
            return "list of " + " or ".join(self.type_str(a, discriminator) for a in args if a is not Ellipsis)
        if origin is dict:
            return f"map of {self.type_str(args[0])} to {self.type_str(args[1])}"
        if origin in (typing.Union, types.UnionType):
            parts = [a for a in args if a is not type(None)]
            if discriminator and all(self._is_model(a) for a in parts):
                tags = [typing.get_args(a.model_fields[discriminator].annotation)[0] for a in parts]
                return f"one of {', '.join(self.link(a, str(t)) for a, t in zip(parts, tags))}, by `{discriminator}`"
            text = " or ".join(self.type_str(a) for a in parts)
            return text + (" or null" if len(parts) < len(args) else "")
        names = {str: "string", int: "integer", float: "number", bool: "boolean", typing.Any: "any"}
        return names.get(ann, getattr(ann, "__name__", str(ann)))

    @staticmethod
    def constraints(field) -> str:
        words = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
        out = []
        for m in field.metadata:
            for attr, sign in words.items():
                if getattr(m, attr, None) is not None:
                    out.append(f"{sign} {getattr(m, attr):,}".replace(",", " "))
            if getattr(m, "min_length", None) is not None:
                out.append(f"length ≥ {m.min_length}")
            if getattr(m, "max_length", None) is not None:
                out.append(f"length ≤ {m.max_length}")
            if getattr(m, "pattern", None):
                out.append(f"matching `{m.pattern}`")
        return ", ".join(out)

    def default_str(self, field) -> str:
        from pydantic_core import PydanticUndefined

        if field.is_required():
            return "required"
        value = field.default_factory() if field.default_factory is not None else field.default
        if value is PydanticUndefined:
            return "required"

        def plain(v):
            if isinstance(v, self.BaseModel):
                return v.model_dump(mode="json", exclude_defaults=True)
            if isinstance(v, (list, tuple)):
                return [plain(x) for x in v]
            if isinstance(v, dict):
                return {k: plain(x) for k, x in v.items()}
            return v

        text = json.dumps(plain(value), ensure_ascii=False)
        return f"`{text}`" + (
            " (every field at its default)" if isinstance(value, self.BaseModel) and text == "{}" else ""
        )

    def render(self) -> str:
        lines = [
            "# Recipe reference",
            "",
            "<!-- Generated from the recipe schema (quantpipe.recipe) by scripts/recipe_docs.py: do not edit by hand. -->",
            "<!-- Regenerate: .venv/quantize/bin/python " + COMMAND + " -->",
            "",
            "A recipe is one YAML file, read with `yaml.safe_load` and validated by quantpipe's pydantic models:",
            "unknown keys are errors, and relative paths are resolved against the recipe file's folder.",
            "`quantpipe check RECIPE` validates a recipe (and the files it names) without running anything and",
            "prints it resolved, with every default; `quantpipe schema` prints the JSON schema, for editor",
            "completion. Rules that span fields (unique artifact names, calibration data for the methods that",
            "need it, options a legacy backend cannot honour) are checked too, each with a message that names",
            "the field and the fix. The shipped recipes in `recipes/` are examples.",
            "",
            "This page is generated from the schema by `scripts/recipe_docs.py`.",
            "",
            "Sections: " + ", ".join(f"[{t}](#{_slug(t)})" for t, _, _ in self.sections) + ".",
        ]
        for title, model, tag in self.sections:
            lines += ["", f"## {title}", ""]
            doc = (model.__dict__.get("__doc__") or "").strip()
            if doc:
                lines += [" ".join(doc.split()), ""]
            lines += ["| field | type | default | description |", "| --- | --- | --- | --- |"]
            fields = sorted(model.model_fields.items(), key=lambda kv: kv[0] != tag)  # the tag first, then field order
            for name, f in fields:
                t = self.type_str(f.annotation, f.discriminator if isinstance(f.discriminator, str) else None)
                c = self.constraints(f)
                desc = " ".join((f.description or "").split())
                cells = [f"`{name}`", t + (f"; {c}" if c else ""), self.default_str(f), desc]
                lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        return "\n".join(lines) + "\n"


def render() -> str:
    """docs/recipes.md as the current schema gives it."""
    _import_quantpipe()
    from quantpipe.recipe import Recipe

    return Reference(Recipe).render()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--check", action="store_true", help=f"exit 1 if {DOC.relative_to(REPO)} differs from what the schema gives"
    )
    a = ap.parse_args()
    text = render()
    if not a.check:
        sys.stdout.write(text)
        return 0
    current = DOC.read_text(encoding="utf-8") if DOC.is_file() else ""
    if current != text:
        print(
            f"{DOC.relative_to(REPO)} is out of date with the recipe schema; regenerate it with `{COMMAND}`",
            file=sys.stderr,
        )
        return 1
    print(f"{DOC.relative_to(REPO)} is current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
