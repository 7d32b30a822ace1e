"""safetensors headers read by hand (8-byte length + JSON), so that checks need no framework and a
truncated or garbled file is reported as a problem instead of crashing."""

from __future__ import annotations

import json
import struct
from pathlib import Path

MAX_HEADER_BYTES = 100 * 2**20
# bytes per element of the safetensors dtypes whose size is whole bytes (sub-byte ones are left unchecked)
DTYPE_BYTES = {
    **dict.fromkeys(("BOOL", "U8", "I8", "F8_E4M3", "F8_E5M2", "F8_E8M0"), 1),
    **dict.fromkeys(("U16", "I16", "F16", "BF16"), 2),
    **dict.fromkeys(("U32", "I32", "F32"), 4),
    **dict.fromkeys(("U64", "I64", "F64"), 8),
}


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


def damage(path: Path) -> str | None:
    """Why a safetensors file is not what its header says (a header that cannot be read, a tensor whose byte range does
    not fit its shape and dtype, data that ends before or after the file does), as a clause; None when it is whole."""
    path = Path(path)
    try:
        header = read_header(path)
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return f"is not a readable safetensors file ({str(e)[:120]})"
    size, end = path.stat().st_size, 0
    for name, t in tensors(header).items():
        try:
            start, stop = (int(x) for x in t["data_offsets"])
            count = 1
            for d in t["shape"]:
                count *= int(d)
        except (KeyError, TypeError, ValueError):
            return f"has a malformed header entry for tensor {name}"
        width = DTYPE_BYTES.get(t.get("dtype"))
        if stop < start or (width is not None and stop - start != count * width):
            return f"has a header whose byte range for tensor {name} ({start}-{stop}) does not fit its shape and dtype"
        end = max(end, stop)
    need = header["__size__"] + end
    if need != size:
        how = "truncated" if need > size else "longer than its tensors"
        return f"is {size} bytes but its header says {need}: the file is {how} (an interrupted download or copy?)"
    return None


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


def weights_bytes(model_dir: Path) -> int:
    """The bytes of a model directory's safetensors shards: what its weights take on disk and, loaded, about in memory."""
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
