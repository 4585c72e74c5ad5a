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
        from planner.cli.tables import Col, print_table
        from planner.models.catalog import describe_models

        rows = describe_models()
        if as_json:
            typer.echo(dumps_json(rows, indent=2))
            return
        cols = [Col("name", whole=True), Col("family, head"), Col("parameters", "right", whole=True),
                Col("layers", "right", whole=True),
                Col("hidden", "right", whole=True), Col("max positions", "right", whole=True)]
        # Names are what users copy into --model: never wrapped (planner.cli.tables), whatever the width.
        print_table(console, "Model catalog (parameters counted exactly; heads as on the hub)", cols,
                    [[r["name"], f"{r['family']}, {r['head']}", f"{r['parameters']:,}",
                      str(r["layers"]), str(r["hidden"]), str(r["max_positions"])] for r in rows])
        console.print("Options: -o head=base|sequence-classification|masked-lm|causal-lm, -o num_labels=N; "
                      "multimodal-bert: text_model, tab_in, tab_out, text_out, num_classes, binary.",
                      highlight=False)
