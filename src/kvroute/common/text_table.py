"""Aligned plain-text tables for the commands that print results."""

from __future__ import annotations


def text_table(rows: list[list[str]]) -> str:
    """Rows of cells as aligned text: the first row is the header, the first column left."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])]
        cells += [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
        if row is rows[0]:
            lines.append("-" * len(lines[-1]))
    return "\n".join(lines)
