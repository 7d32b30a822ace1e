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
    """A string as one line of Markdown text that renders as itself, in a table cell or a paragraph: HTML as entities
    (a `<script>` in a recipe's notes is shown, never run), no link or image it did not mean, no code span it did not
    open, no cell edge. Brackets alone stay as they are (intervals read `[0.1, 0.2]`)."""
    s = " ".join(str(v).splitlines())
    s = s.replace("\\", "\\\\").replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    for raw in ("|", "`", "![", "](", "]["):
        s = s.replace(raw, "\\" + raw)
    return s


def md_code(v) -> str:
    """A string as a one-line Markdown code span: shown verbatim (never HTML), fenced by more backticks than it holds."""
    s = " ".join(str(v).splitlines()).replace("|", "\\|")  # GFM ends a table cell at `|` even inside code
    ticks = "`" * (_longest_backticks(s) + 1)
    pad = " " if s.startswith("`") or s.endswith("`") else ""
    return f"{ticks}{pad}{s}{pad}{ticks}"


def md_fence(text) -> str:
    """The backtick fence of a code block that holds `text`: longer than any run of backticks inside it."""
    return "`" * max(3, _longest_backticks(str(text)) + 1)


def _longest_backticks(s: str) -> int:
    run = best = 0
    for ch in s:
        run = run + 1 if ch == "`" else 0
        best = max(best, run)
    return best


def fidelity_text(fid: dict) -> str:
    """An evaluation's fidelity figures in words, each with its 95% interval, and what they rest on (report and model card)."""

    def figure(key: str, spec: str) -> str:
        v, ci = fid.get(key), fid.get(f"{key}_ci95")
        if not isinstance(v, (int, float)):
            return "—"
        has_ci = isinstance(ci, (list, tuple)) and len(ci) == 2 and all(isinstance(x, (int, float)) for x in ci)
        return f"{v:{spec}}" + (f" [{ci[0]:{spec}}, {ci[1]:{spec}}]" if has_ci else "")

    text = (
        f"mean next-token KL divergence {figure('kl_mean', '.2g')}, top-1 agreement {figure('top1_agreement', '.4f')}"
    )
    if isinstance(fid.get("ppl"), (int, float)):
        base = fid.get("ppl_baseline")
        text += (
            f", perplexity {figure('ppl', '.4g')} (baseline {f'{base:.4g}' if isinstance(base, (int, float)) else '—'}"
        )
        text += f", ratio {figure('ppl_ratio', '.4f')})" if isinstance(fid.get("ppl_ratio"), (int, float)) else ")"
    n, w, source = fid.get("n_tokens"), fid.get("n_windows"), fid.get("source")
    if isinstance(n, int):
        text += f"; {n} tokens" + {
            "documents": f" of held-out documents in {w} windows",
            "validation": f" of {w} validation references",
        }.get(source, "")
    if fid.get("ci_method"):
        text += f"; 95% intervals: {fid['ci_method']}"
    return text
