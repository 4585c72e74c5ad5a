"""The `planner` command: each sub-command lives in its own module and registers itself here."""

from __future__ import annotations

import typer

from planner.cli import catalog_cmd, estimate_cmd, models_cmd, prices_cmd, probe_cmd, report_cmd, search_cmd

app = typer.Typer(
    name="planner",
    help="Will it fit, how fast, how much: capacity planning for training on Amazon SageMaker.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

for module in (estimate_cmd, models_cmd, catalog_cmd, search_cmd, prices_cmd, probe_cmd, report_cmd):
    module.register(app)


def main() -> None:
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
