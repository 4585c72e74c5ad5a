"""`planner models`: the model catalog as a table or JSON."""

from __future__ import annotations

import typer

from planner.cli.common import JsonOpt, console, handles_errors
from planner.io import dumps_json


def _millions(n: int) -> str:
    return f"{n / 1e6:,.1f}M" if n < 1e9 else f"{n / 1e9:,.2f}B"


def register(app: typer.Typer) -> None:
    @app.command("models")
    @handles_errors
    def models(as_json: JsonOpt = False) -> None:
        """List the catalog models (use a name with --model; any config.json path works too)."""
        from rich.table import Table

        from planner.models.catalog import describe_models

        rows = describe_models()
        if as_json:
            typer.echo(dumps_json(rows, indent=2))
            return
        table = Table(title="Model catalog (parameters counted exactly; heads as on the hub)")
        for col, justify in (("name", "left"), ("family", "left"), ("head", "left"), ("parameters", "right"),
                             ("", "right"), ("layers", "right"), ("hidden", "right"), ("max positions", "right")):
            # Names are what users copy into --model: never wrap them, whatever the terminal width.
            table.add_column(col, justify=justify, no_wrap=col == "name")  # type: ignore[arg-type]
        for r in rows:
            table.add_row(r["name"], r["family"], r["head"], f"{r['parameters']:,}", _millions(r["parameters"]),
                          str(r["layers"]), str(r["hidden"]), str(r["max_positions"]))
        console.print(table)
        console.print("Options: -o head=base|sequence-classification|masked-lm|causal-lm, -o num_labels=N; "
                      "multimodal-bert: text_model, tab_in, tab_out, text_out, num_classes, binary.",
                      highlight=False)
