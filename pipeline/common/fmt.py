"""Numbers and sizes as the report, the model card and the console show them."""

from __future__ import annotations


def fmt(v, digits: int = 3) -> str:
    """A number for a table: fixed decimals, scientific when tiny or huge, '—' when not measured."""
    if v is None or (isinstance(v, float) and (v != v or v in (float("inf"), float("-inf")))):
        return "—"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int) or v == 0:
        return str(v)
    if abs(v) < 1e-3 or abs(v) >= 1e6:
        return f"{v:.{digits}g}"
    return f"{v:.{digits}f}"


def human_bytes(n) -> str:
    if not isinstance(n, (int, float)):
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def md_cell(v) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")
