"""Fixed-width text tables of the ``bench compare`` commands: a column spec and the lines it formats.

Owns layout only (header, one line per row, the ratio/skipped/note lines under a comparison);
what goes in a column is the caller's. Pure formatting: no I/O, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable


@dataclass(frozen=True)
class Column:
    """One table column.

    Args:
        header: the column's title, padded like its cells.
        width: characters of each cell (a longer text is not cut).
        value: a row's value for this column.
        spec: ``format`` spec of the value (``".2f"``); a None value is shown as ``"n/a"``.
        align: ``">"`` (right, numbers) or ``"<"`` (left, names).
        gap: spaces before the cell (and before the header).
    """

    header: str
    width: int
    value: Callable[[Any], Any]
    spec: str = ""
    align: str = ">"
    gap: int = 0

    def pad(self, text: str) -> str:
        """``text`` padded to ``width`` with ``align``, after ``gap`` spaces."""
        return " " * self.gap + format(text, f"{self.align}{self.width}")

    def cell(self, row: Any) -> str:
        """This column's cell of ``row``."""
        value = self.value(row)
        return self.pad("n/a" if value is None else format(value, self.spec))


def format_rows(columns: Iterable[Column], rows: Iterable[Any]) -> list[str]:
    """The header line, then one line per row: each line the columns' cells side by side."""
    columns = list(columns)
    return ["".join(c.pad(c.header) for c in columns), *("".join(c.cell(row) for c in columns) for row in rows)]


def comparison_lines(ratios: dict[str, float], skipped: dict[str, str], notes: list[str]) -> list[str]:
    """The lines under a comparison table: ``name: 1.23x`` per ratio, ``skipped PEER: reason`` per
    skipped peer, ``note: ...`` per note, in that order."""
    return ([f"{name}: {value:.2f}x" for name, value in ratios.items()]
            + [f"skipped {peer}: {reason}" for peer, reason in skipped.items()]
            + [f"note: {n}" for n in notes])
