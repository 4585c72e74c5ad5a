"""What a configuration costs: $/hour for the whole job, $ per million samples, hours and $ per epoch.

    job $/h        = instance $/h * instances * (1 - spot discount if spot)
    $ / 1M samples = job $/h / 3600 / samples_per_s * 1e6
    hours / epoch  = dataset_size / samples_per_s / 3600
    hours / job    = hours / epoch * epochs;   $ / job = hours / job * job $/h

`throughput.samples_per_s` is already the whole job's rate (all GPUs of all instances).
The instance price comes from `price_per_hour=` when given, else from planner.prices (data: the refreshed
cache `results/prices.json` when present, else the embedded table in planner/data/instances.json); this
module never imports the AWS client code (planner.aws.pricing only refreshes that table).
"""

from __future__ import annotations

from planner.errors import PlannerError
from planner.spec import Cost, Instance, Throughput

SECONDS_PER_HOUR = 3600.0
# Managed spot training: AWS says spot "can optimize the cost of training models up to 90% over on-demand"
# (https://docs.aws.amazon.com/sagemaker/latest/dg/model-managed-spot-training.html). Up to 90% is the
# best case; GPU spot discounts typically sit around 60-70% and vary by instance, region and time, and
# interruptions lengthen the wall-clock time (not modelled here). ASSUMPTION: 70% off on-demand.
DEFAULT_SPOT_DISCOUNT = 0.70


def _instance_price(instance: Instance, region: str | None = None) -> tuple[float | None, str, str]:
    """(USD per instance-hour, date, source) in `region` (None: us-east-1) from the pricing module, falling back to
    the Instance itself only in the region its own price is for (never another region's price)."""
    from planner.prices import DEFAULT_REGION

    where = region or DEFAULT_REGION
    try:
        from planner.prices import price_per_hour

        price, date, source = price_per_hour(instance.name, where)
        if price is not None:
            return price, date, f"{source} ({date})" if date else source
    except PlannerError as exc:
        if exc.field != "--instance":  # an instance the price table lacks falls back; a corrupt cache is an error
            raise
    if instance.price_per_hour is not None and instance.price_region == where:
        return instance.price_per_hour, instance.price_date, f"{instance.price_source} ({instance.price_date})"
    return None, "", ""


def predict_cost(throughput: Throughput, instance: Instance, *, instances: int = 1, dataset_size: int | None = None,
                 spot: bool = False, spot_discount: float | None = None,
                 price_per_hour: float | None = None, epochs: float | None = None,
                 region: str | None = None) -> Cost:
    """Cost of the job; `price_per_hour` (per instance, on-demand) overrides the known price in `region`
    (None: us-east-1); `epochs` passes over `dataset_size` make the job (None: one epoch)."""
    if instances < 1:
        raise PlannerError("--instances", instances, "an integer >= 1")
    if dataset_size is not None and dataset_size < 1:
        raise PlannerError("--dataset-size", dataset_size, "an integer >= 1")
    discount = DEFAULT_SPOT_DISCOUNT if spot_discount is None else spot_discount
    if not 0.0 <= discount < 1.0:
        raise PlannerError("--spot-discount", discount, "a fraction in [0, 1)")
    if price_per_hour is not None:
        if price_per_hour <= 0:
            raise PlannerError("--price-per-hour", price_per_hour, "a positive USD amount")
        unit, source, date = price_per_hour, "given by the user", ""
    else:
        found, date, source = _instance_price(instance, region)
        if found is None:
            raise PlannerError("--instance", instance.name, "an instance with a known price"
                               f"{' in ' + region if region else ''}, or --price-per-hour")
        unit = found
    job_price = unit * instances * ((1.0 - discount) if spot else 1.0)
    if spot:
        source += f"; managed spot at {discount:.0%} off (assumed)"
    rate = throughput.samples_per_s
    per_million = job_price / SECONDS_PER_HOUR / rate * 1e6 if rate > 0 else float("inf")
    hours = usd = None
    if dataset_size is not None and rate > 0:
        hours = dataset_size / rate / SECONDS_PER_HOUR
        usd = hours * job_price
    from planner.prices import DEFAULT_REGION, is_stale

    stale = None if price_per_hour is not None else is_stale(instance.name, date)
    cost = Cost(price_per_hour=job_price, spot=spot, usd_per_million_samples=per_million, dataset_size=dataset_size,
                hours_per_epoch=hours, usd_per_epoch=usd, price_source=source, price_region=region or DEFAULT_REGION,
                price_date=date, price_stale=stale)
    return per_job(cost, 1.0 if epochs is None else epochs)


def per_job(cost: Cost, epochs: float) -> Cost:
    """`cost` with the job's figures for `epochs` passes: hours/job = hours/epoch × epochs, $/job likewise.

    Pure and cheap, so a search can price one estimate for any recipe without estimating it again."""
    if epochs <= 0:
        raise PlannerError("--epochs", epochs, "a positive number of passes over the dataset")
    hours = None if cost.hours_per_epoch is None else cost.hours_per_epoch * epochs
    usd = None if cost.usd_per_epoch is None else cost.usd_per_epoch * epochs
    return cost.model_copy(update={"epochs": epochs, "hours_per_job": hours, "usd_per_job": usd})
