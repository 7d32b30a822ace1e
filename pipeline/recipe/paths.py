"""Paths as types in the recipe schema. A field that names a local file or folder is annotated with a `LocalPathMarker`
(through `LocalFile`, `LocalDir`, `ModelDir`, `AdapterDir` or `Place`), which says whether it is a file or a folder,
whether it may instead be a hub id, and whether it is an input (checked before a run, counted by its content in a
stage's cache key) or a place the pipeline writes to. Resolving relative paths, the existence checks and the cache key
all find the paths by walking the models' fields, so a new path field takes part in all three by its type alone:

    from quantpipe.recipe.paths import path_values
    [loc for loc, value, marker in path_values(recipe)]   # ['output_dir', 'base.model', 'adapters.0.path', ...]
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class LocalPathMarker:
    """What a path field names: a file or a folder (`is_dir`), one that may instead be a hub id (`hub_id`), an input
    the run reads or a place it writes (`place`: resolved, never checked or hashed), the suffixes a file must have,
    what a folder must hold (`holds`: a model or a LoRA adapter, checked by `recipe.load`) and a hint for a missing one."""

    is_dir: bool
    hub_id: bool = False
    place: bool = False
    suffixes: tuple[str, ...] = ()
    holds: Literal["model", "adapter"] | None = None
    hint: str = ""


LocalFile = Annotated[str, LocalPathMarker(is_dir=False)]
LocalDir = Annotated[str, LocalPathMarker(is_dir=True)]
ModelDir = Annotated[str, LocalPathMarker(is_dir=True, hub_id=True, holds="model")]
AdapterDir = Annotated[str, LocalPathMarker(is_dir=True, holds="adapter")]
Place = Annotated[str, LocalPathMarker(is_dir=True, place=True)]


def is_local(value: str) -> bool:
    """A `hub_id` path names a local folder when one exists there or when it is not shaped like a hub id (org/name)."""
    return Path(value).exists() or not HUB_ID.match(value)


def _marker(annotation: Any, metadata: list | tuple = ()) -> LocalPathMarker | None:
    """The marker of a field's type, in its metadata or inside Annotated/Optional around it."""
    for m in metadata:
        if isinstance(m, LocalPathMarker):
            return m
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        inner, *meta = typing.get_args(annotation)
        return _marker(inner, meta)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            if (m := _marker(arg)) is not None:
                return m
    return None


def _arms(annotation: Any) -> list:
    """The types a value of `annotation` may have: Annotated unwrapped, a union split, None left out."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _arms(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [t for arg in typing.get_args(annotation) for t in _arms(arg)]
    return [] if annotation is type(None) else [annotation]


def _is_model(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, BaseModel)


def _container_item(arms: list, kind: type) -> Any:
    """The item type of the first `list[...]`/`tuple[...]` (kind list) or `dict[..., V]` (kind dict) among the arms."""
    for t in arms:
        origin = typing.get_origin(t)
        if kind is list and origin in (list, tuple) and typing.get_args(t):
            return typing.get_args(t)[0]
        if kind is dict and origin is dict and len(typing.get_args(t)) == 2:
            return typing.get_args(t)[1]
    return None


# --- a validated model ----------------------------------------------------------------------------


def path_values(model: BaseModel, loc: str = "") -> Iterator[tuple[str, str, LocalPathMarker]]:
    """Every path set in a validated model, depth-first in field order: (dotted location, value, marker)."""
    for name, f in type(model).model_fields.items():
        yield from _values(getattr(model, name), f.annotation, f.metadata, f"{loc}{name}")


def input_paths(model: BaseModel) -> Iterator[tuple[str, str, LocalPathMarker]]:
    """The local files and folders a validated model reads: its paths less the places it writes and the hub ids."""
    for loc, value, marker in path_values(model):
        if not marker.place and (not marker.hub_id or is_local(value)):
            yield loc, value, marker


def _values(value: Any, annotation: Any, metadata: list, loc: str) -> Iterator[tuple[str, str, LocalPathMarker]]:
    if value is None:
        return
    marker = _marker(annotation, metadata)
    if marker is not None and isinstance(value, str):
        yield loc, value, marker
    elif isinstance(value, BaseModel):
        yield from path_values(value, f"{loc}.")
    elif isinstance(value, (list, tuple)):
        item = _container_item(_arms(annotation), list)
        for i, v in enumerate(value):
            yield from _values(v, item, (), f"{loc}.{i}")
    elif isinstance(value, dict):
        item = _container_item(_arms(annotation), dict)
        for k, v in value.items():
            yield from _values(v, item, (), f"{loc}.{k}")


# --- raw recipe data, before validation -----------------------------------------------------------


def map_paths(data: Any, model: type[BaseModel], fn: Callable[[str, str, LocalPathMarker], str]) -> Any:
    """`data` (a recipe's parsed YAML, shaped like `model`) with fn(value, location, marker) applied to every path
    string; what is not shaped as the schema expects is left as it is, for the schema to refuse."""
    return _map(data, model, (), "", fn)


def _map(value: Any, annotation: Any, metadata: list | tuple, loc: str, fn) -> Any:
    marker = _marker(annotation, metadata)
    if marker is not None:
        return fn(value, loc, marker) if isinstance(value, str) else value
    arms = _arms(annotation)
    if isinstance(value, dict):
        models = [t for t in arms if _is_model(t)]
        model = _pick(models, value)
        if model is not None:
            fields = model.model_fields
            prefix = f"{loc}." if loc else ""
            return {
                k: _map(v, fields[k].annotation, fields[k].metadata, f"{prefix}{k}", fn) if k in fields else v
                for k, v in value.items()
            }
        item = _container_item(arms, dict)
        if item is not None:
            return {k: _map(v, item, (), f"{loc}.{k}", fn) for k, v in value.items()}
    if isinstance(value, list):
        item = _container_item(arms, list)
        if item is not None:
            return [_map(v, item, (), f"{loc}.{i}", fn) for i, v in enumerate(value)]
    return value


def _pick(models: list, value: dict) -> type[BaseModel] | None:
    """The model a mapping validates as: the only one, or of a tagged union the one whose Literal fields it matches."""
    if len(models) <= 1:
        return models[0] if models else None
    for m in models:
        tags = {
            k: typing.get_args(f.annotation)
            for k, f in m.model_fields.items()
            if typing.get_origin(f.annotation) is Literal and k in value
        }
        if tags and all(value[k] in allowed for k, allowed in tags.items()):
            return m
    return None
