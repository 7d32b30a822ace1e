"""safetensors headers read by hand (8-byte length + JSON), so that checks need no framework and a
truncated or garbled file is reported as a problem instead of crashing."""

from __future__ import annotations

import json
import struct
from pathlib import Path

MAX_HEADER_BYTES = 100 * 2**20


def read_header(path: Path) -> dict:
    """The JSON header of a safetensors file, plus `__size__` (the header's bytes); ValueError when malformed."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("shorter than a safetensors header")
        n = struct.unpack("<Q", head)[0]
        if n > MAX_HEADER_BYTES or n > path.stat().st_size - 8:
            raise ValueError(f"header length {n} is impossible for a {path.stat().st_size}-byte file")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    header["__size__"] = 8 + n
    return header


def tensors(header: dict) -> dict:
    """The tensor entries of a header (without `__metadata__` and `__size__`)."""
    return {k: v for k, v in header.items() if not k.startswith("__")}


def param_count(files) -> int | None:
    """Elements in every file's tensors, from the headers; None if any header is unreadable (or no tensor)."""
    total = 0
    for f in files:
        try:
            for v in tensors(read_header(f)).values():
                size = 1
                for s in v["shape"]:
                    size *= int(s)
                total += size
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None
    return total or None
