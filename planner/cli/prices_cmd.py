"""`planner prices`: the SageMaker training prices the planner uses, and `--refresh` from the AWS Price List API."""

from __future__ import annotations

from typing import Annotated

import typer

from planner.cli.common import JsonOpt, console, err_console, fail, handles_errors
from planner.io import dumps_json

RefreshOpt = Annotated[bool, typer.Option("--refresh", help="Fetch current prices from the AWS Price List API "
                                                            "and cache them in results/prices.json.")]
RegionOpt = Annotated[str, typer.Option("--region", help="Region to price (the API itself is called in us-east-1).")]


def _rows() -> list[dict[str, object]]:
    from planner.aws.pricing import load_cache, lookup
    from planner.hardware import get_instance, list_instances

    cache = load_cache()
    rows = []
    for name in list_instances():
        price, date, source = lookup(name, cache)
        rows.append({"instance": name, "gpus": get_instance(name).gpus, "gpu": get_instance(name).gpu.family,
                     "usd_per_hour": price, "date": date, "source": source})
    return rows


def _short(source: str) -> str:
    """The source's first clause, for the table (`--json` has it whole)."""
    if source.startswith("DERIVED"):
        return "derived: EC2 price x1.25 (see --json)"
    return source.split(" (")[0].split(",")[0].split(" http")[0][:48]


@handles_errors
def prices(refresh: RefreshOpt = False, region: RegionOpt = "us-east-1", json_out: JsonOpt = False) -> None:
    """Show on-demand SageMaker training prices (instance, GPUs, $/h, date, source)."""
    from planner.aws import pricing

    if refresh:
        try:
            path, count = pricing.refresh(region)
        except pricing.PricingError as exc:
            fail(str(exc), 2)
        err_console.print(f"cached {count} SageMaker training prices for {region} in {path}", highlight=False)
    rows = _rows()
    if json_out:
        typer.echo(dumps_json(rows, indent=1))
        return
    from planner.cli.tables import Col, print_table

    cols = [Col("instance", whole=True), Col("GPUs", whole=True), Col("$/h", "right", whole=True),
            Col("date", whole=True), Col("source")]
    print_table(console, "SageMaker training, on-demand USD per instance-hour", cols, [
        [str(r["instance"]), f"{r['gpus']}x {r['gpu']}", "-" if r["usd_per_hour"] is None else f"{r['usd_per_hour']:.3f}",
         str(r["date"]), _short(str(r["source"]))] for r in rows])


def register(app: typer.Typer) -> None:
    app.command("prices")(prices)
