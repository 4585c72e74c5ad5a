"""SageMaker training prices: the embedded table, a refreshed cache, and the AWS Price List API.

`price_per_hour(name)` answers from `results/prices.json` when that cache exists and lists the instance
(written by `planner prices --refresh`), else from the embedded table in planner/data/instances.json.

The refresh asks the AWS Price List API (boto3 `pricing` client; its endpoint lives in us-east-1 whatever
region is priced) for ServiceCode "AmazonSageMaker" with TERM_MATCH filters regionCode=<region> and
component=Training, pages through `get_products`, and reads each PriceList entry (a JSON string):
product.attributes.instanceType ("ml.p3.2xlarge" or "ml.p3.2xlarge-Training") / usagetype
("USE1-Train:ml.p3.2xlarge"), and terms.OnDemand.*.priceDimensions.*.pricePerUnit.USD with unit "Hrs".
boto3 is imported only when refreshing.

Without AWS credentials the refresh reads the public Price List bulk offer files instead, which need none
(https://docs.aws.amazon.com/awsaccountbilling/latest/aboutv2/using-the-aws-price-list-bulk-api-fetching-price-list-files-manually.html):
the service index `/offers/v1.0/aws/index.json` → `offers.AmazonSageMaker.currentRegionIndexUrl` (the region
index, reading-the-offer-index.html) → `regions.<region>.currentVersionUrl` (service-region-infex-file-for-
service.html) → that region's offer file, whose `products.<sku>.attributes` and `terms.OnDemand.<sku>` are the
same records the API returns one by one (so `parse_price_list` reads both).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

# The table itself is data (planner.prices, beside the GPU facts); this module only refreshes it. The names
# below are re-exported so that existing callers keep working.
from planner.prices import (  # noqa: F401
    API_SOURCE,
    CACHE_ENV,
    DEFAULT_CACHE,
    DEFAULT_REGION,
    MAX_PRICE_PER_HOUR,
    cache_path,
    embedded_prices,
    load_cache,
    lookup,
    price_per_hour,
)

# A silent endpoint (one that accepts the connection and never answers) held `--refresh` for 182 s: botocore's
# defaults are a 60 s connect and read timeout, tried 3 times (botocore/config.py; the "legacy" retry mode).
# A Price List page answers in about a second; so at most 5 s to connect and 10 s to read, tried twice:
# 30 s at worst, which the command says before it asks.
# https://botocore.amazonaws.com/v1/documentation/api/latest/reference/config.html
PRICING_TIMEOUTS: dict[str, float] = {"connect_timeout": 5.0, "read_timeout": 10.0}
PRICING_ATTEMPTS = 2
BULK_ENV = "PLANNER_PRICE_LIST_URL"  # where the bulk files are served (a mirror, or a test's local server)
BULK_BASE_URL = "https://pricing.us-east-1.amazonaws.com"
BULK_INDEX = "/offers/v1.0/aws/index.json"
BULK_SOURCE = "AWS Price List bulk offer file (AmazonSageMaker, Training, On-Demand)"
# The bulk files: the same bounds as the API (a silent endpoint must not hold the command for minutes).
NETWORK_TIMEOUT_S = PRICING_TIMEOUTS["read_timeout"]
PRICING_API_REGION = "us-east-1"  # the Price List API endpoints: us-east-1, eu-central-1, ap-south-1
SERVICE_CODE = "AmazonSageMaker"
COMPONENT = "Training"


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


def pricing_client() -> Any:
    """The Price List API client, bounded as PRICING_TIMEOUTS and PRICING_ATTEMPTS say (boto3 imported here:
    only a refresh needs it)."""
    import boto3
    from botocore.config import Config

    return boto3.client("pricing", region_name=PRICING_API_REGION, config=Config(
        **PRICING_TIMEOUTS, retries={"total_max_attempts": PRICING_ATTEMPTS, "mode": "standard"}))


def fetch_prices(region: str = DEFAULT_REGION, client: Any = None) -> dict[str, float]:
    """All SageMaker Training on-demand prices in `region` from the Price List API (paginated)."""
    if client is None:
        client = pricing_client()
    filters = [
        {"Type": "TERM_MATCH", "Field": "regionCode", "Value": region},
        {"Type": "TERM_MATCH", "Field": "component", "Value": COMPONENT},
    ]
    prices: dict[str, float] = {}
    try:
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            ConnectTimeoutError,
            NoCredentialsError,
            ReadTimeoutError,
        )
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
    except (ReadTimeoutError, ConnectTimeoutError) as exc:
        raise PricingError(f"AWS Pricing API did not answer ({exc}; {PRICING_ATTEMPTS} tries of at most "
                           f"{PRICING_TIMEOUTS['connect_timeout']:g} s to connect and "
                           f"{PRICING_TIMEOUTS['read_timeout']:g} s to answer); the cached and embedded prices "
                           "are unchanged") from None
    except BotoCoreError as exc:
        raise PricingError(f"AWS Pricing API unreachable: {exc}") from None
    if not prices:
        raise PricingError(f"the Price List API returned no SageMaker Training prices for region {region!r}")
    return prices


def offer_file_items(offer: Mapping[str, Any]) -> Iterable[dict[str, Any]]:
    """A region's bulk offer file as the API's PriceList records: {"product": products[sku], "terms":
    {"OnDemand": terms.OnDemand[sku]}} for each sku (the offer file keys its terms by sku, then term code)."""
    products = offer.get("products") or {}
    on_demand = (offer.get("terms") or {}).get("OnDemand") or {}
    if not isinstance(products, Mapping) or not isinstance(on_demand, Mapping):
        raise PricingError("the offer file has no products/terms.OnDemand objects (not a Price List offer file)")
    for sku, product in products.items():
        yield {"product": product, "terms": {"OnDemand": on_demand.get(sku) or {}}}


def _get_json(url: str, timeout: float) -> dict[str, Any]:
    """GET a JSON document; every failure is one PricingError line naming the URL."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310  (https or a local mirror)
            data = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise PricingError(f"{url}: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise PricingError(f"{url}: unreachable ({reason}); the cached and embedded prices are unchanged") from None
    except ValueError:
        raise PricingError(f"{url}: not JSON") from None
    if not isinstance(data, dict):
        raise PricingError(f"{url}: not a JSON object")
    return data


def fetch_bulk_prices(region: str = DEFAULT_REGION, base_url: str | None = None,
                      timeout: float = NETWORK_TIMEOUT_S) -> tuple[dict[str, float], str]:
    """SageMaker Training on-demand prices in `region` from the public bulk offer files (no credentials), and
    the offer file's URL and publication date as their source."""
    import os
    from urllib.parse import urljoin

    base = (base_url or os.environ.get(BULK_ENV) or BULK_BASE_URL).rstrip("/") + "/"
    index = _get_json(urljoin(base, BULK_INDEX.lstrip("/")), timeout)
    offer = (index.get("offers") or {}).get(SERVICE_CODE) or {}
    if not offer.get("currentRegionIndexUrl"):
        raise PricingError(f"the Price List index at {base} has no offers.{SERVICE_CODE}.currentRegionIndexUrl")
    regions = _get_json(urljoin(base, offer["currentRegionIndexUrl"].lstrip("/")), timeout)
    entry = (regions.get("regions") or {}).get(region) or {}
    if not entry.get("currentVersionUrl"):
        raise PricingError(f"the {SERVICE_CODE} region index lists no offer file for region {region!r}")
    url = urljoin(base, entry["currentVersionUrl"].lstrip("/"))
    data = _get_json(url, timeout)
    prices = parse_price_list(offer_file_items(data), region)
    if not prices:
        raise PricingError(f"{url}: no SageMaker Training on-demand prices for region {region!r}")
    published = str(data.get("publicationDate", ""))
    return prices, f"{BULK_SOURCE}: {url}" + (f", published {published}" if published else "")


def has_credentials(client: Any) -> bool:
    """Whether a boto3 client would sign its requests (a client made without credentials has none to sign
    with); a client of another kind (a test's fake) counts as having them."""
    signer = getattr(client, "_request_signer", None)
    return signer is None or getattr(signer, "_credentials", None) is not None


def write_cache(prices: Mapping[str, float], region: str, path: str | Path | None = None,
                fetched: str | None = None, source: str | None = None) -> Path:
    """Write `region`'s prices into the cache atomically (temporary file + rename), so a failure never leaves
    half a file; the other regions already refreshed stay ({"regions": {region: {...}}})."""
    from planner.prices import cache_regions

    p = Path(path) if path is not None else cache_path()
    regions = cache_regions(load_cache(p)) if p.exists() else {}
    regions[region] = {"fetched": fetched or _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                       "source": source or f"{API_SOURCE}: pricing.get_products(ServiceCode={SERVICE_CODE}, "
                                           f"regionCode={region}, component={COMPONENT})",
                       "prices": dict(sorted(prices.items()))}
    from planner.io import write_json

    # The refreshed region also at the top ("fetched", "region", "source", "prices": the one-region layout
    # earlier versions wrote and read); "regions" holds every region refreshed so far.
    data = {**regions[region], "region": region, "regions": dict(sorted(regions.items()))}
    return write_json(p, data, "prices cache", indent=1)


def refresh(region: str = DEFAULT_REGION, path: str | Path | None = None, client: Any = None,
            base_url: str | None = None) -> tuple[Path, int]:
    """Fetch and cache; the cache is written only after a complete, successful fetch. With AWS credentials the
    Price List API answers; without, the public bulk offer files do."""
    if client is None:
        client = pricing_client()
    if not has_credentials(client):
        prices, source = fetch_bulk_prices(region, base_url)
        return write_cache(prices, region, path, source=source), len(prices)
    prices = fetch_prices(region, client=client)
    return write_cache(prices, region, path), len(prices)
