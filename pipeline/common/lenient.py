"""Field types for records read back from disk (run.json and the stage metrics inside it): a damaged or missing part
reads as None, an empty container or a default model, never as an error, so one malformed field cannot sink a report.
Values of the right type pass through unchanged (an int stays an int), so a record written from these models reads
back as written.

    class Row(Lenient):
        concurrency: Int = None
        goodput: Num = None
    Row.model_validate({"concurrency": "x", "goodput": float("nan")})  # Row(concurrency=None, goodput=None)
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, model_serializer


class Lenient(BaseModel):
    """A record part: every field lenient, unknown fields kept (a newer writer's additions survive a read). Dumped,
    it holds what was given or filled in since, never a default nobody set."""

    model_config = ConfigDict(extra="allow")

    @model_serializer(mode="wrap")
    def _given(self, handler):
        data = handler(self)
        keep = self.model_fields_set | set(self.model_extra or ())
        return {k: v for k, v in data.items() if k in keep or v not in (None, [], {})}


def number(v: Any) -> int | float | None:
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def integer(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def label(v: Any) -> str | None:
    """A label (variant, workload, task, status) as a string, so a malformed one cannot break grouping."""
    return None if v is None else v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str)


def pair(v: Any) -> list[float] | None:
    """A recorded [lo, hi] interval as floats; None for anything else."""
    ok = isinstance(v, (list, tuple)) and len(v) == 2 and all(number(x) is not None for x in v)
    return [float(v[0]), float(v[1])] if ok else None


def _flag(v: Any) -> bool | None:
    return v if isinstance(v, bool) else None


def _mapping(v: Any) -> dict:
    return v if isinstance(v, dict) else {}


def _listing(v: Any) -> list:
    return v if isinstance(v, list) else []


def _part(v: Any) -> Any:
    return v if isinstance(v, (dict, BaseModel)) else {}


def _parts(v: Any) -> list:
    return [x for x in v if isinstance(x, (dict, BaseModel))] if isinstance(v, list) else []


def _parts_by_name(v: Any) -> dict:
    return {str(k): x for k, x in v.items() if isinstance(x, (dict, BaseModel))} if isinstance(v, dict) else {}


def _strings(v: Any) -> list:
    return [label(x) for x in v if x is not None] if isinstance(v, list) else []


Num = Annotated[int | float | None, BeforeValidator(number)]
Int = Annotated[int | None, BeforeValidator(integer)]
Text = Annotated[str | None, BeforeValidator(label)]
Flag = Annotated[bool | None, BeforeValidator(_flag)]
Pair = Annotated[list[float] | None, BeforeValidator(pair)]
Obj = Annotated[dict[str, Any], BeforeValidator(_mapping)]
Seq = Annotated[list[Any], BeforeValidator(_listing)]
Texts = Annotated[list[str], BeforeValidator(_strings)]


def Part(model: type[BaseModel]):  # noqa: N802 - a type constructor, read like `list[...]`
    """A nested record part: anything but a dict reads as the model's defaults."""
    return Annotated[model, BeforeValidator(_part)]


def Parts(model: type[BaseModel]):  # noqa: N802
    """A list of record parts: entries that are not dicts are dropped."""
    return Annotated[list[model], BeforeValidator(_parts)]


def PartsByName(model: type[BaseModel]):  # noqa: N802
    """A name -> record part mapping: entries that are not dicts are dropped."""
    return Annotated[dict[str, model], BeforeValidator(_parts_by_name)]
