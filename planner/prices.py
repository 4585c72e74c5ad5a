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
from pathlib import Path
from typing import Any

from planner import caches
from planner.errors import unknown
from planner.hardware import instance_table, normalize_instance_name

DEFAULT_REGION = "us-east-1"
CACHE_ENV = "PLANNER_PRICES"
DEFAULT_CACHE = Path("results") / "prices.json"
API_SOURCE = "AWS Price List API (AmazonSageMaker, component Training, On-Demand)"
# ASSUMPTION: no SageMaker training instance costs more than this per hour (the dearest, ml.p6-b200.48xlarge
# and ml.p5en.48xlarge, list well under $200/h on demand); a bigger figure in a cache is a corrupt file.
MAX_PRICE_PER_HOUR = 10_000.0


STALE_AFTER_DAYS = 180
# Known price changes: a price dated before one of these, for an instance of these families, is stale whatever
# its age (planner/data/instances.json "price_changes", each with its source).


def price_changes() -> list[dict[str, Any]]:
    from planner.hardware import _load

    return list(_load("instances.json").get("price_changes", []))


def _month(date: str) -> str:
    """"2024-12", "2024-12-01" or "2024-12-01T00:00:00Z" -> "2024-12" ("" when absent)."""
    return str(date or "")[:7]


def is_stale(name: str, date: str, today: str | None = None) -> bool:
    """True when the price is older than STALE_AFTER_DAYS, undated, or predates a known price change of its
    family (planner/data/instances.json price_changes)."""
    import datetime as _dt

    if not date:
        return True
    when = _dt.date.fromisoformat(_month(date) + "-01") if len(str(date)) < 10 else \
        _dt.date.fromisoformat(str(date)[:10])
    now = _dt.date.fromisoformat(today) if today else _dt.date.today()
    if (now - when).days > STALE_AFTER_DAYS:
        return True
    family = normalize_instance_name(name).rsplit(".", 1)[0]
    return any(family in change["families"] and _month(date) < change["date"] for change in price_changes())


def embedded_prices() -> dict[str, dict[str, Any]]:
    """{instance: {price, date, source, region}} from planner/data/instances.json."""
    return {name: {"price": rec.get("price_per_hour"), "date": rec.get("price_date", ""),
                   "source": rec.get("price_source", ""), "region": rec.get("price_region", DEFAULT_REGION)}
            for name, rec in instance_table().items()}


def embedded_regions() -> list[str]:
    """Regions the embedded table prices (only us-east-1 today)."""
    return sorted({rec.get("price_region", DEFAULT_REGION) for rec in instance_table().values()})


def cache_regions(cache: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """{region: {"fetched", "source", "prices"}} of a cache in either layout: one region per file (what
    `--refresh` wrote before) or {"regions": {...}} (one entry per refreshed region)."""
    if not cache:
        return {}
    if isinstance(cache.get("regions"), Mapping):
        return dict(cache["regions"])
    region = cache.get("region") or DEFAULT_REGION
    return {region: {"fetched": cache.get("fetched", ""), "source": cache.get("source", API_SOURCE),
                     "prices": cache.get("prices", {})}}


def priced_regions(cache: Mapping[str, Any] | None) -> list[str]:
    """Every region with prices: the embedded table's and the refreshed cache's."""
    return sorted(set(embedded_regions()) | set(cache_regions(cache)))


def check_region(region: str, cache: Mapping[str, Any] | None) -> str:
    """`region` if prices exist for it; else bad input: an unknown name lists the AWS regions, a known region
    without prices says how to get them."""
    from planner.dlc import DLC_ACCOUNTS
    from planner.errors import PlannerError

    key = str(region).strip().lower()
    priced = priced_regions(cache)
    if key in priced:
        return key
    if key not in DLC_ACCOUNTS:
        raise unknown("--region", region, sorted(set(DLC_ACCOUNTS) | set(priced)))
    raise PlannerError("--region", region, f"a region with prices ({', '.join(priced)}); no prices for this region: "
                       f"run `planner prices --refresh --region {key}`")


def lookup(name: str, cache: Mapping[str, Any] | None,
           region: str = DEFAULT_REGION) -> tuple[float | None, str, str]:
    """(price, date, source) for an instance in `region` (pure): the cache's entry for that region when it has
    one, else the embedded row when it prices that region, else (None, "", why). Never another region's."""
    key = normalize_instance_name(name)
    cached = cache_regions(cache).get(region)
    if cached and key in cached.get("prices", {}):
        return float(cached["prices"][key]), str(cached.get("fetched", "")), \
            f"{cached.get('source', API_SOURCE)}, {region}"
    rec = instance_table().get(key)  # the embedded row (embedded_prices() for all of them)
    if rec is None:
        known = list(instance_table()) + list((cached or {}).get("prices", {}))
        raise unknown("--instance", name, known)
    if rec.get("price_region", DEFAULT_REGION) != region:
        return None, "", f"no price for {key} in {region} (not in the refreshed cache; the embedded table " \
                         f"prices {rec.get('price_region', DEFAULT_REGION)} only)"
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


@caches.lru(8, scope="facts", key="(path, mtime, size) of the price file")
def _read_cache(path: str, _mtime_ns: int, _size: int) -> dict[str, Any]:
    """Parsed and checked once per file version (the key holds its mtime and size): a search prices
    thousands of configurations and must not re-read the JSON for each."""
    from planner.errors import PlannerError
    from planner.io import number, read_json

    p = Path(path)
    what = f"prices cache (${CACHE_ENV}; delete it or run `planner prices --refresh`)"
    data = read_json(p, what)
    regions = data.get("regions") if "regions" in data else {"": data}
    if not isinstance(regions, dict) or not all(isinstance(r, dict) for r in regions.values()):
        raise PlannerError(f"{p}: regions", regions, 'an object {"us-east-1": {"prices": {...}}, ...}')
    for region, entry in regions.items():
        prices = entry.get("prices")
        where = f"{p}: " + (f"regions.{region}.prices" if region else "prices")
        if not isinstance(prices, dict):
            raise PlannerError(where, prices, 'an object {"ml.p3.2xlarge": 3.825, ...}')
        for name, usd in prices.items():
            number(usd, f"{where}.{name}", low=0, high=MAX_PRICE_PER_HOUR, low_open=True)
    return data


def price_per_hour(instance_name: str, region: str = DEFAULT_REGION) -> tuple[float | None, str, str]:
    """(USD per instance-hour, date, source) in `region`: the refreshed cache when it lists the instance there,
    else the embedded row when it prices that region, else None with the reason as source."""
    return lookup(instance_name, load_cache(), region)


def short_source(source: str) -> str:
    """A price source's first clause (the whole text stays in the JSON outputs)."""
    if not source:
        return "unknown source"
    if source.startswith("DERIVED"):
        return "derived: EC2 price x1.25"
    return source.split(" (")[0].split(",")[0].split(" http")[0][:60]


def provenance(region: str, date: str, source: str, stale: bool | None) -> str:
    """One line saying where a price comes from: region, date, source, and whether it is stale (`stale_hint`
    says how to refresh it); every output that shows a cost prints it (estimate, explain, search, the report)."""
    if source.startswith("given by the user"):
        return "price: given by the user (--price-per-hour)"
    when = f"dated {date}" if date else "undated"
    line = f"price: {region or DEFAULT_REGION}, {when}, {short_source(source)}"
    return line + (", STALE" if stale else "")


def stale_hint(region: str) -> str:
    """The command that refreshes a stale price."""
    return f"refresh: planner prices --refresh --region {region or DEFAULT_REGION}"


def cost_provenance(cost: Any, hint: bool = False) -> str:
    """`provenance` of a `spec.Cost` (`hint`: with the refresh command when stale)."""
    line = provenance(cost.price_region, cost.price_date, cost.price_source, cost.price_stale)
    return line + (f" ({stale_hint(cost.price_region)})" if hint and cost.price_stale else "")


def price_records(instances: list[str], region: str = DEFAULT_REGION) -> list[dict[str, Any]]:
    """Each instance type's on-demand price with its provenance (region, date, source, stale) and how it is
    billed: SageMaker bills the whole instance, every GPU of it, whatever a configuration uses (a one-GPU
    strategy on a 4-GPU instance pays for four). For the outputs of a search (best.json, the report)."""
    from planner.hardware import get_instance

    cache = load_cache()
    out = []
    for name in instances:
        price, date, source = lookup(name, cache, region)
        out.append({"instance": name, "usd_per_hour": price, "region": region, "date": date, "source": source,
                    "stale": None if price is None else is_stale(name, date), "gpus": get_instance(name).gpus,
                    "billed": "per instance-hour, all of its GPUs"})
    return out


def provenance_summary(records: list[dict[str, Any]]) -> list[str]:
    """`provenance` of several instance types' prices, one line per distinct (region, date, source, stale)."""
    groups: dict[tuple[Any, ...], list[str]] = {}
    for r in records:
        if r["usd_per_hour"] is None:
            continue
        key = (r["region"], r["date"], short_source(str(r["source"])), bool(r["stale"]))
        groups.setdefault(key, []).append(str(r["instance"]))
    lines = []
    for (region, date, source, stale), names in groups.items():
        line = provenance(region, date, source, stale)
        lines.append(line if len(records) == 1 else f"{line} ({len(names)} type{'s' if len(names) != 1 else ''})")
    return lines
