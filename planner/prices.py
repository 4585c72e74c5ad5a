"""Instance prices as data: the embedded table beside the GPU facts, or the refreshed cache.

The price of each instance type lives in planner/data/instances.json (with its source and date), next
to its GPUs. `planner prices --refresh` (planner.aws.pricing, the only module that talks to AWS) writes
a newer table to `results/prices.json` (or $PLANNER_PRICES); this module reads whichever applies, so
the cost model (planner.perf.cost) depends on data only, not on boto3 or the AWS client
(ARCHITECTURE.md: facts are data; I/O at the edges).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from planner.errors import unknown
from planner.hardware import instance_table, normalize_instance_name

DEFAULT_REGION = "us-east-1"
CACHE_ENV = "PLANNER_PRICES"
DEFAULT_CACHE = Path("results") / "prices.json"
API_SOURCE = "AWS Price List API (AmazonSageMaker, component Training, On-Demand)"
# ASSUMPTION: no SageMaker training instance costs more than this per hour (the dearest, ml.p6-b200.48xlarge
# and ml.p5en.48xlarge, list well under $200/h on demand); a bigger figure in a cache is a corrupt file.
MAX_PRICE_PER_HOUR = 10_000.0


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
    rec = instance_table().get(key)  # the embedded row (embedded_prices() for all of them)
    if rec is None:
        known = list(instance_table()) + list((cache or {}).get("prices", {}))
        raise unknown("--instance", name, known)
    return rec.get("price_per_hour"), rec.get("price_date", ""), rec.get("price_source", "")


def cache_path() -> Path:
    return Path(_cache_location())


def _cache_location() -> str | Path:
    """`cache_path` without making a Path (every estimate looks for the cache)."""
    return os.environ.get(CACHE_ENV, DEFAULT_CACHE)


def load_cache(path: str | Path | None = None) -> dict[str, Any] | None:
    """The refreshed price cache, or None when absent; a cache that is not what `--refresh` writes is an error
    naming the file (a corrupt cache must not be silently replaced by other prices, nor reach `--json`)."""
    from planner.io import file_version

    version = file_version(path if path is not None else _cache_location())
    return _read_cache(*version) if version is not None else None


@lru_cache(maxsize=8)
def _read_cache(path: str, _mtime_ns: int, _size: int) -> dict[str, Any]:
    """Parsed and checked once per file version (the key holds its mtime and size): a search prices
    thousands of configurations and must not re-read the JSON for each."""
    from planner.errors import PlannerError
    from planner.io import number, read_json

    p = Path(path)
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
