"""SageMaker training prices: the embedded table, a refreshed cache, and the AWS Price List API.

`price_per_hour(name)` answers from `results/prices.json` when that cache exists and lists the instance
(written by `planner prices --refresh`), else from the embedded table in planner/data/instances.json.

The refresh asks the AWS Price List API (boto3 `pricing` client; its endpoint lives in us-east-1 whatever
region is priced) for ServiceCode "AmazonSageMaker" with TERM_MATCH filters regionCode=<region> and
component=Training, pages through `get_products`, and reads each PriceList entry (a JSON string):
product.attributes.instanceType ("ml.p3.2xlarge" or "ml.p3.2xlarge-Training") / usagetype
("USE1-Train:ml.p3.2xlarge"), and terms.OnDemand.*.priceDimensions.*.pricePerUnit.USD with unit "Hrs".
boto3 is imported only when refreshing.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from planner.errors import unknown
from planner.hardware import instance_table, normalize_instance_name

PRICING_API_REGION = "us-east-1"  # the Price List API endpoints: us-east-1, eu-central-1, ap-south-1
SERVICE_CODE = "AmazonSageMaker"
COMPONENT = "Training"
DEFAULT_REGION = "us-east-1"
CACHE_ENV = "PLANNER_PRICES"
DEFAULT_CACHE = Path("results") / "prices.json"
# ASSUMPTION: no SageMaker training instance costs more than this per hour (the dearest, ml.p6-b200.48xlarge
# and ml.p5en.48xlarge, list well under $200/h on demand); a bigger figure in a cache is a corrupt file.
MAX_PRICE_PER_HOUR = 10_000.0
API_SOURCE = "AWS Price List API (AmazonSageMaker, component Training, On-Demand)"


class PricingError(Exception):
    """The AWS side failed (credentials, permissions, throttling, network): one line for the user."""


# ---- pure parsing --------------------------------------------------------------------------------


def _instance_of(attributes: Mapping[str, Any]) -> str | None:
    """'ml.p3.2xlarge' from instanceType ('ml.p3.2xlarge-Training') or usagetype ('USE1-Train:ml.p3.2xlarge')."""
    name = str(attributes.get("instanceType") or "")
    if name.startswith("ml."):
        return name.split("-")[0]
    usage = str(attributes.get("usagetype") or "")
    if ":ml." in usage:
        return usage.split(":", 1)[1].split("-")[0]
    return None


def _is_training(attributes: Mapping[str, Any]) -> bool:
    component = str(attributes.get("component") or attributes.get("platoinstancetype") or "")
    usage = str(attributes.get("usagetype") or "")
    return component.lower() == "training" or "-Train:" in usage


def parse_price_list(price_list: Iterable[str | Mapping[str, Any]], region: str | None = None) -> dict[str, float]:
    """{instance: USD per hour} from `get_products` PriceList entries (JSON strings or dicts).

    Keeps On-Demand, per-hour ("Hrs"), Training products in `region` (when given); a zero price or a
    non-training product (Hosting, Notebook, SpotTraining, HyperPod) is skipped.
    """
    prices: dict[str, float] = {}
    for raw in price_list:
        item = json.loads(raw) if isinstance(raw, str) else raw
        attrs = item.get("product", {}).get("attributes", {})
        if region and attrs.get("regionCode") not in (None, region):
            continue
        if not _is_training(attrs):
            continue
        name = _instance_of(attrs)
        if not name:
            continue
        for term in item.get("terms", {}).get("OnDemand", {}).values():
            for dim in term.get("priceDimensions", {}).values():
                if str(dim.get("unit", "")).lower() not in ("hrs", "hours", "hour"):
                    continue
                try:
                    usd = float(dim.get("pricePerUnit", {}).get("USD", "0") or 0)
                except (TypeError, ValueError):
                    continue
                if math.isfinite(usd) and 0 < usd <= MAX_PRICE_PER_HOUR:
                    prices[name] = usd
    return prices


def embedded_prices() -> dict[str, dict[str, Any]]:
    """{instance: {price, date, source, region}} from planner/data/instances.json."""
    return {name: {"price": rec.get("price_per_hour"), "date": rec.get("price_date", ""),
                   "source": rec.get("price_source", ""), "region": rec.get("price_region", DEFAULT_REGION)}
            for name, rec in instance_table().items()}


def lookup(name: str, cache: Mapping[str, Any] | None) -> tuple[float | None, str, str]:
    """(price, date, source) for an instance (pure): the cache's entry when it has one, else the embedded one."""
    key = normalize_instance_name(name)
    if cache and key in cache.get("prices", {}):
        region = cache.get("region", "")
        return float(cache["prices"][key]), str(cache.get("fetched", "")), f"{cache.get('source', API_SOURCE)}, {region}"
    table = embedded_prices()
    if key not in table:
        known = list(table) + list((cache or {}).get("prices", {}))
        raise unknown("--instance", name, known)
    rec = table[key]
    return rec["price"], rec["date"], rec["source"]


# ---- I/O edge ------------------------------------------------------------------------------------


def cache_path() -> Path:
    return Path(os.environ.get(CACHE_ENV, DEFAULT_CACHE))


def load_cache(path: str | Path | None = None) -> dict[str, Any] | None:
    """The refreshed price cache, or None when absent; a cache that is not what `--refresh` writes is an error
    naming the file (a corrupt cache must not be silently replaced by other prices, nor reach `--json`)."""
    from planner.errors import PlannerError
    from planner.io import number, read_json

    p = Path(path) if path is not None else cache_path()
    if not p.exists():
        return None
    what = f"prices cache (${CACHE_ENV}; delete it or run `planner prices --refresh`)"
    data = read_json(p, what)
    prices = data.get("prices")
    if not isinstance(prices, dict):
        raise PlannerError(f"{p}: prices", prices, 'an object {"ml.p3.2xlarge": 3.825, ...}')
    for name, usd in prices.items():
        number(usd, f"{p}: prices.{name}", low=0, high=MAX_PRICE_PER_HOUR, low_open=True)
    return data


def price_per_hour(instance_name: str) -> tuple[float | None, str, str]:
    """(USD per instance-hour, date, source): the refreshed cache when it lists the instance, else embedded."""
    return lookup(instance_name, load_cache())


def fetch_prices(region: str = DEFAULT_REGION, client: Any = None) -> dict[str, float]:
    """All SageMaker Training on-demand prices in `region` from the Price List API (paginated)."""
    if client is None:
        import boto3

        client = boto3.client("pricing", region_name=PRICING_API_REGION)
    filters = [
        {"Type": "TERM_MATCH", "Field": "regionCode", "Value": region},
        {"Type": "TERM_MATCH", "Field": "component", "Value": COMPONENT},
    ]
    prices: dict[str, float] = {}
    try:
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError
    except ImportError as exc:  # pragma: no cover - boto3 is a dependency
        raise PricingError(f"boto3/botocore are needed for --refresh ({exc})") from None
    try:
        paginator = client.get_paginator("get_products")
        for page in paginator.paginate(ServiceCode=SERVICE_CODE, Filters=filters, FormatVersion="aws_v1"):
            prices.update(parse_price_list(page.get("PriceList", []), region))
    except NoCredentialsError:
        raise PricingError("no AWS credentials found (set AWS_PROFILE or AWS_ACCESS_KEY_ID/SECRET); "
                           "the cached and embedded prices are unchanged") from None
    except ClientError as exc:
        err = exc.response.get("Error", {})
        code, msg = err.get("Code", "ClientError"), err.get("Message", str(exc))
        hint = {"AccessDeniedException": "the credentials need pricing:GetProducts",
                "AccessDenied": "the credentials need pricing:GetProducts",
                "ThrottlingException": "the Price List API throttled the request; try again shortly"}.get(code, "")
        raise PricingError(f"AWS Pricing API error {code}: {msg}{'; ' + hint if hint else ''}") from None
    except BotoCoreError as exc:
        raise PricingError(f"AWS Pricing API unreachable: {exc}") from None
    if not prices:
        raise PricingError(f"the Price List API returned no SageMaker Training prices for region {region!r}")
    return prices


def write_cache(prices: Mapping[str, float], region: str, path: str | Path | None = None,
                fetched: str | None = None) -> Path:
    """Write the cache atomically (temporary file + rename), so a failure never leaves half a file."""
    p = Path(path) if path is not None else cache_path()
    data = {"fetched": fetched or _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "region": region,
            "source": API_SOURCE, "prices": dict(sorted(prices.items()))}
    from planner.io import write_json

    return write_json(p, data, "prices cache", indent=1)


def refresh(region: str = DEFAULT_REGION, path: str | Path | None = None, client: Any = None) -> tuple[Path, int]:
    """Fetch and cache; the cache is written only after a complete, successful fetch."""
    prices = fetch_prices(region, client=client)
    return write_cache(prices, region, path), len(prices)
