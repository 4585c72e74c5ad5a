"""Help that fits 80 columns and keeps every word whole.

Typer's rich help panels cut long flag names to fit their columns (`--global-batch-si…`) and wrap numbers
mid-digit; `planner.cli.main` turns them off (`rich_markup_mode=None`) for click's plain layout. That layout
wraps with textwrap, which still breaks at hyphens (`no-gradient-as-` / `bucket-view`, a flag's default) and
cuts any word longer than a line; `keep_words_whole` makes it break at spaces only.
"""

from __future__ import annotations

from typing import Any


def keep_words_whole() -> None:
    """Make the help formatter's TextWrapper break lines at spaces only (idempotent). Click imports the class
    at each call of `wrap_text`, so replacing the module attribute is enough."""
    try:  # typer >= 0.17 carries its own copy of click
        from typer._click import _textwrap
    except ImportError:  # pragma: no cover
        from click import _textwrap  # type: ignore[no-redef]

    base = _textwrap.TextWrapper
    if getattr(base, "keeps_words_whole", False):
        return

    class WholeWords(base):  # type: ignore[misc,valid-type]
        keeps_words_whole = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("break_on_hyphens", False)
            kwargs.setdefault("break_long_words", False)
            super().__init__(*args, **kwargs)

    _textwrap.TextWrapper = WholeWords
