"""`planner prices`: the SageMaker training prices the planner uses, and `--refresh` from the AWS Price List API
(with AWS credentials) or its public bulk offer files (without)."""

from __future__ import annotations

from typing import Annotated

import typer

from planner.cli.common import JsonOpt, console, err_console, fail, handles_errors
from planner.io import dumps_json

RefreshOpt = Annotated[bool, typer.Option("--refresh", help="Fetch current prices (the AWS Price List API with "
                                                            "credentials, its public offer files without) and "
                                                            "cache them in results/prices.json.")]
RegionOpt = Annotated[str, typer.Option("--region", help="Region to price (the API itself is called in us-east-1).")]
PriceRegionOpt = Annotated[str, typer.Option("--region", help="Region whose SageMaker prices the cost uses.")]
REFRESH_HINT = "planner prices --refresh --region {region}"


def _rows(region: str) -> list[dict[str, object]]:
    from planner.aws.pricing import load_cache, lookup
    from planner.hardware import get_instance, list_instances
    from planner.prices import check_region, is_stale

    cache = load_cache()
    region = check_region(region, cache)
    rows = []
    for name in list_instances():
        price, date, source = lookup(name, cache, region)
        inst = get_instance(name)
        rows.append({"instance": name, "gpus": inst.gpus, "gpu": inst.gpu.family, "region": region,
                     "usd_per_hour": price, "spot_usd_per_hour": None, "date": date, "source": source,
                     "stale": None if price is None else is_stale(name, date),
                     "note": "" if price is not None else source})
    return rows


def stale_line(region: str, count: int) -> str:
    """The one line that says prices are stale, with the command that refreshes them."""
    what = "the price is stale" if count == 1 else f"{count} stale prices"
    return f"note: {what}; refresh: {REFRESH_HINT.format(region=region)}"


def _short(source: str) -> str:
    """The source's first clause, for the table (`--json` has it whole)."""
    if source.startswith("DERIVED"):
        return "derived: EC2 price x1.25 (see --json)"
    if source.startswith("no "):
        return "none (reason: see --json)"
    return source.split(" (")[0].split(",")[0].split(" http")[0][:48]


@handles_errors
def prices(refresh: RefreshOpt = False, region: RegionOpt = "us-east-1", json_out: JsonOpt = False) -> None:
    """Show on-demand SageMaker training prices (instance, GPUs, $/h, date, source)."""
    from planner.aws import pricing

    if refresh:
        from planner.aws.images import DLC_ACCOUNTS
        from planner.errors import unknown

        if region not in DLC_ACCOUNTS:
            raise unknown("--region", region, sorted(DLC_ACCOUNTS))
        try:
            path, count = pricing.refresh(region)
        except pricing.PricingError as exc:
            fail(str(exc), 2)
        err_console.print(f"cached {count} SageMaker training prices for {region} in {path}", highlight=False)
    rows = _rows(region)
    stale = sum(1 for r in rows if r["stale"])
    if json_out:
        typer.echo(dumps_json(rows, indent=1))
        return
    from planner.cli.tables import Col, print_table

    cols = [Col("instance", whole=True), Col("GPUs", whole=True), Col("$/h", "right", whole=True),
            Col("date", whole=True), Col("source")]
    print_table(console, f"SageMaker training, on-demand USD per instance-hour, {rows[0]['region']}", cols, [
        [str(r["instance"]), f"{r['gpus']}x {r['gpu']}", "-" if r["usd_per_hour"] is None else
         f"{r['usd_per_hour']:.3f}" + ("*" if r["stale"] else ""), str(r["date"]), _short(str(r["source"]))]
        for r in rows])
    if stale:
        console.print("* stale: older than 180 days, or dated before a known price change", highlight=False)
        console.print(stale_line(str(rows[0]["region"]), stale), highlight=False)


def register(app: typer.Typer) -> None:
    app.command("prices")(prices)
