"""Tables that stay readable at 80 columns and when piped: no cell is ever cut to "…".

Rich cuts cells with an ellipsis by default when a table is wider than the terminal. Here every column
folds (wraps) instead, except the "whole" ones (names users copy into flags, numbers): those are never split.
When even the whole columns cannot fit side by side, the table is printed one record per block
("name" line, then "  header: value" lines), which any width can hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

Justify = Literal["left", "right", "center"]


# A folding column is at least this wide (or its longest word, if shorter), so that words are rarely split.
FOLD_MIN_WIDTH = 10
GAP = 1  # characters between columns


@dataclass(frozen=True)
class Col:
    """One column: `whole` cells are never wrapped (identifiers, numbers); the others fold, at least `min` wide."""

    header: str
    justify: Justify = "left"
    whole: bool = False
    min: int | None = None


def min_widths(columns: Sequence[Col], rows: Sequence[Sequence[str]]) -> list[int]:
    """Each column's narrowest width: whole columns their longest cell; folding ones their longest word, capped."""
    out = []
    for i, c in enumerate(columns):
        cells = [str(r[i]) for r in rows]
        if c.whole:
            out.append(max([len(v) for v in cells] + [len(w) for w in c.header.split()] + [1]))
        else:
            longest_word = max([len(w) for v in cells + [c.header] for w in v.split()] + [1])
            out.append(min(longest_word, c.min or FOLD_MIN_WIDTH))
    return out


def natural_widths(columns: Sequence[Col], rows: Sequence[Sequence[str]], *, headers_wrap: bool = False) -> list[int]:
    """Each column's width with no cell wrapped: its longest cell, or header (its longest word if headers wrap)."""
    return [max([len(str(r[i])) for r in rows]
                + ([len(w) for w in c.header.split()] if headers_wrap else [len(c.header)]) + [1])
            for i, c in enumerate(columns)]


def widths_for(total: int, columns: Sequence[Col], rows: Sequence[Sequence[str]]) -> list[int]:
    """Natural widths when they fit in `total` (headers on one line, else wrapped); else folding columns share
    what the whole ones leave, each at least its minimum, the rest in proportion to how much more it wants."""
    room = total - GAP * (len(columns) - 1)
    for headers_wrap in (False, True):
        natural = natural_widths(columns, rows, headers_wrap=headers_wrap)
        if sum(natural) <= room:
            return natural
    low = min_widths(columns, rows)
    widths = list(low)
    spare = room - sum(low)
    want = [n - w for n, w in zip(natural, low, strict=True)]
    total_want = sum(want) or 1
    for i, w in enumerate(want):
        widths[i] += spare * w // total_want
    return widths


def build_table(title: str | None, columns: Sequence[Col], rows: Sequence[Sequence[str]],
                caption: str | None = None, width: int = 80) -> Table:
    """A compact table (one space between columns, a rule under the header) whose cells fold, never cut."""
    table = Table(title=title, caption=caption, box=box.SIMPLE_HEAD, padding=(0, 0), show_edge=False,
                  title_justify="left", caption_justify="left")
    for c, w in zip(columns, widths_for(width, columns, rows), strict=True):
        # width >= the longest cell of a whole column, so its cells never wrap while its header may
        table.add_column(c.header, justify=c.justify, overflow="fold", width=w)
    for r in rows:
        table.add_row(*(Text(str(v)) for v in r))
    return table


def fits(console: Console, columns: Sequence[Col], rows: Sequence[Sequence[str]]) -> bool:
    """Whether every column can have its narrowest width side by side in the console's width."""
    return sum(min_widths(columns, rows)) + GAP * (len(columns) - 1) <= console.width


def print_table(console: Console, title: str | None, columns: Sequence[Col], rows: Sequence[Sequence[str]],
                caption: str | None = None) -> None:
    """Print as a table when it fits `console.width`, else one record per block."""
    if fits(console, columns, rows):
        console.print(build_table(title, columns, rows, caption, console.width))
        return
    print_records(console, title, columns, rows, caption)


def print_records(console: Console, title: str | None, columns: Sequence[Col], rows: Sequence[Sequence[str]],
                  caption: str | None = None) -> None:
    """One record per block: the first column as the heading, then `header: value` for the others."""
    if title:
        console.print(Text(title, style="italic"))
    width = max((len(c.header) for c in columns[1:]), default=0)
    for r in rows:
        console.print(Text(str(r[0]), style="bold"), overflow="fold")
        for c, v in zip(columns[1:], r[1:], strict=True):
            console.print(Text(f"  {c.header.ljust(width)}  {v}"), overflow="fold")
    if caption:
        console.print(Text(caption, style="dim"))


class Rows:
    """The rich `Table` calls (add_column, add_row) collected, then printed by `print_table`."""

    def __init__(self, title: str | None = None, caption: str | None = None):
        self.title, self.caption = title, caption
        self.columns: list[Col] = []
        self.rows: list[list[str]] = []

    def add_column(self, header: str, justify: Justify = "left", whole: bool = False, min: int | None = None) -> None:
        self.columns.append(Col(header, justify, whole, min))

    def add_row(self, *cells: object) -> None:
        self.rows.append([str(c) for c in cells])

    def print(self, console: Console) -> None:
        print_table(console, self.title, self.columns, self.rows, self.caption)
