"""Prices: embedded table, the refresh from the AWS Price List API (botocore Stubber), the cache, the CLI."""

from __future__ import annotations

import json

import boto3
import pytest
from botocore.exceptions import NoCredentialsError
from botocore.stub import Stubber
from typer.testing import CliRunner

from planner.aws import pricing
from planner.cli.main import app
from planner.errors import PlannerError


def price_item(instance: str, usd: str, *, region: str = "us-east-1", component: str = "Training",
               usage_prefix: str = "USE1-Train") -> str:
    """One PriceList entry as `get_products` returns it (a JSON string), AmazonSageMaker product shape."""
    sku = f"SKU{abs(hash((instance, component, region))) % 10**8:08d}"
    return json.dumps({
        "product": {
            "productFamily": "ML Instance",
            "attributes": {
                "regionCode": region, "servicecode": "AmazonSageMaker", "usagetype": f"{usage_prefix}:{instance}",
                "locationType": "AWS Region", "location": "US East (N. Virginia)", "servicename": "Amazon SageMaker",
                "instanceType": f"{instance}-{component}", "component": component, "platoinstancetype": component,
                "platoinstancename": instance, "operation": "RunInstance", "vCpu": "8", "memory": "61 GiB",
                "physicalGpu": "1", "gpuMemory": "16", "computeType": "GPU Instance", "currentGeneration": "Yes",
            },
            "sku": sku,
        },
        "serviceCode": "AmazonSageMaker",
        "terms": {"OnDemand": {f"{sku}.JRTCKXETXF": {
            "priceDimensions": {f"{sku}.JRTCKXETXF.6YS6EN2CT7": {
                "unit": "Hrs", "endRange": "Inf", "beginRange": "0", "appliesTo": [],
                "description": f"${usd} per Hour for {usage_prefix.split('-')[1]}:{instance} in US East (N. Virginia)",
                "rateCode": f"{sku}.JRTCKXETXF.6YS6EN2CT7", "pricePerUnit": {"USD": usd}}},
            "sku": sku, "effectiveDate": "2024-11-01T00:00:00Z", "offerTermCode": "JRTCKXETXF", "termAttributes": {}}}},
        "version": "20241101000000", "publicationDate": "2024-11-01T00:00:00Z",
    })


REAL_CLIENT = boto3.client  # tests below monkeypatch boto3.client
FILTERS = [{"Type": "TERM_MATCH", "Field": "regionCode", "Value": "us-east-1"},
           {"Type": "TERM_MATCH", "Field": "component", "Value": "Training"}]
PAGE_1 = {"FormatVersion": "aws_v1", "NextToken": "page-2",
          "PriceList": [price_item("ml.p3.2xlarge", "3.8250000000"), price_item("ml.g5.xlarge", "1.4080000000"),
                        price_item("ml.g5.xlarge", "1.0060000000", component="Hosting", usage_prefix="USE1-Host")]}
PAGE_2 = {"FormatVersion": "aws_v1",
          "PriceList": [price_item("ml.p4d.24xlarge", "37.6880000000"), price_item("ml.p3.2xlarge", "0.0000000000",
                                                                                     component="SpotTraining")]}


def stubbed_client(responses=(PAGE_1, PAGE_2), error: str | None = None):
    client = REAL_CLIENT("pricing", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="y")
    stub = Stubber(client)
    base = {"ServiceCode": "AmazonSageMaker", "Filters": FILTERS, "FormatVersion": "aws_v1"}
    if error:
        stub.add_client_error("get_products", service_error_code=error, service_message="denied by test",
                              http_status_code=400 if error == "ThrottlingException" else 403, expected_params=base)
    else:
        for i, resp in enumerate(responses):
            params = dict(base) if i == 0 else {**base, "NextToken": responses[i - 1]["NextToken"]}
            stub.add_response("get_products", resp, params)
    stub.activate()
    return client, stub


def test_parse_keeps_on_demand_training_hours_only():
    prices = pricing.parse_price_list(PAGE_1["PriceList"] + PAGE_2["PriceList"], "us-east-1")
    assert prices == {"ml.p3.2xlarge": 3.825, "ml.g5.xlarge": 1.408, "ml.p4d.24xlarge": 37.688}
    assert pricing.parse_price_list(PAGE_1["PriceList"], "eu-west-1") == {}


def test_fetch_paginates_and_writes_cache(tmp_path):
    client, stub = stubbed_client()
    path, count = pricing.refresh("us-east-1", tmp_path / "prices.json", client=client)
    stub.assert_no_pending_responses()
    data = json.loads(path.read_text())
    assert count == 3 and data["region"] == "us-east-1" and data["fetched"] and "Price List API" in data["source"]
    price, date, source = pricing.lookup("p3.2xlarge", data)
    assert price == 3.825 and date == data["fetched"] and "us-east-1" in source


@pytest.mark.parametrize("code", ["AccessDeniedException", "ThrottlingException"])
def test_aws_errors_become_one_line_and_leave_the_cache(tmp_path, code):
    cache = tmp_path / "prices.json"
    cache.write_text('{"prices": {"ml.p3.2xlarge": 1.0}, "fetched": "old"}')
    client, _ = stubbed_client(error=code)
    with pytest.raises(pricing.PricingError, match=code) as err:
        pricing.refresh("us-east-1", cache, client=client)
    assert "\n" not in str(err.value)
    assert json.loads(cache.read_text())["fetched"] == "old"


class NoCredsClient:
    def get_paginator(self, name):
        raise NoCredentialsError()


def test_no_credentials(tmp_path):
    with pytest.raises(pricing.PricingError, match="no AWS credentials"):
        pricing.refresh("us-east-1", tmp_path / "p.json", client=NoCredsClient())
    assert not (tmp_path / "p.json").exists()


def test_embedded_prices_and_cache_override(tmp_path, monkeypatch):
    monkeypatch.setenv(pricing.CACHE_ENV, str(tmp_path / "absent.json"))
    price, date, source = pricing.price_per_hour("ml.p3.16xlarge")
    assert price == 28.152 and date and "pricing" in source.lower()
    cache = tmp_path / "prices.json"
    pricing.write_cache({"ml.p3.16xlarge": 30.0}, "us-east-1", cache, fetched="2030-01-01T00:00:00Z")
    monkeypatch.setenv(pricing.CACHE_ENV, str(cache))
    assert pricing.price_per_hour("ML.P3.16XLARGE")[:2] == (30.0, "2030-01-01T00:00:00Z")
    assert pricing.price_per_hour("ml.p3.2xlarge")[0] == 3.825  # not in the cache -> embedded
    with pytest.raises(PlannerError, match="did you mean"):
        pricing.price_per_hour("ml.p3.2xlarg")


# ---- CLI ------------------------------------------------------------------------------------------

runner = CliRunner()


def test_cli_prices_table_and_json(tmp_path, monkeypatch):
    monkeypatch.setenv(pricing.CACHE_ENV, str(tmp_path / "absent.json"))
    result = runner.invoke(app, ["prices", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert {r["instance"] for r in rows} >= {"ml.p3.16xlarge", "ml.p5.48xlarge"}
    for r in rows:  # a price with its region, date, source and staleness, or none with the reason
        assert r["region"] == "us-east-1" and r["source"], r
        assert (r["usd_per_hour"] is None) == (r["stale"] is None), r
        if r["usd_per_hour"] is not None:
            assert r["usd_per_hour"] > 0 and r["date"], r
    by_name = {r["instance"]: r for r in rows}
    assert by_name["ml.p3.16xlarge"]["stale"] and by_name["ml.p5e.48xlarge"]["usd_per_hour"] is None
    table = runner.invoke(app, ["prices"])
    assert table.exit_code == 0 and "planner prices --refresh --region us-east-1" in table.output


def test_stale_rule_age_and_known_price_changes():
    from planner.prices import is_stale

    assert is_stale("ml.g5.xlarge", "2024-12", today="2026-11-26")  # older than 180 days
    assert not is_stale("ml.g5.xlarge", "2026-10-01", today="2026-11-26")
    assert not is_stale("ml.p5.48xlarge", "2025-07", today="2025-08-01")  # after the June 2025 cut
    assert is_stale("ml.p5.48xlarge", "2025-05", today="2025-08-01")  # before it, though young
    assert not is_stale("ml.g5.xlarge", "2025-05", today="2025-08-01")  # the cut was P4/P5 only
    assert is_stale("ml.g5.xlarge", "")


def test_regions_are_honoured_never_copied(tmp_path, monkeypatch):
    cache = tmp_path / "prices.json"
    monkeypatch.setenv(pricing.CACHE_ENV, str(cache))
    unknown_region = runner.invoke(app, ["prices", "--region", "mars-1"])
    assert unknown_region.exit_code == 2 and "us-east-1" not in unknown_region.output.split("allowed:")[0]
    unpriced = runner.invoke(app, ["prices", "--region", "eu-west-1", "--json"])
    assert unpriced.exit_code == 2 and "no prices for this region" in unpriced.output
    for cmd in (["estimate", "--model", "bert-base-uncased", "--instance", "ml.g5.xlarge"],
                ["explain", "--model", "bert-base-uncased", "--instance", "ml.g5.xlarge"]):
        assert runner.invoke(app, [*cmd, "--region", "mars-1"]).exit_code == 2
    # A refreshed region: its own prices; a type it lacks has none (not us-east-1's).
    import datetime as dt

    today = dt.date.today().isoformat() + "T00:00:00Z"  # fresh whenever the test runs
    pricing.write_cache({"ml.g5.xlarge": 1.6}, "eu-west-1", cache, fetched=today)
    pricing.write_cache({"ml.g5.xlarge": 1.4}, "us-east-1", cache, fetched=today)
    rows = {r["instance"]: r for r in json.loads(runner.invoke(app, ["prices", "--region", "eu-west-1",
                                                                        "--json"]).output)}
    assert rows["ml.g5.xlarge"]["usd_per_hour"] == 1.6 and rows["ml.g5.xlarge"]["region"] == "eu-west-1"
    assert rows["ml.p3.2xlarge"]["usd_per_hour"] is None and "eu-west-1" in rows["ml.p3.2xlarge"]["note"]
    assert pricing.price_per_hour("ml.g5.xlarge", "us-east-1")[0] == 1.4  # both regions kept
    est = json.loads(runner.invoke(app, ["estimate", "--model", "bert-base-uncased", "--instance", "ml.g5.xlarge",
                                         "--region", "eu-west-1", "--json"]).output)
    assert est["cost"]["price_region"] == "eu-west-1" and est["cost"]["price_stale"] is False
    assert est["cost"]["price_per_hour"] == 1.6
    none = json.loads(runner.invoke(app, ["estimate", "--model", "bert-base-uncased", "--instance",
                                          "ml.p3.2xlarge", "--region", "eu-west-1", "--json"]).output)
    assert none["cost"] is None


def test_cli_refresh_success_and_errors(tmp_path, monkeypatch):
    cache = tmp_path / "prices.json"
    monkeypatch.setenv(pricing.CACHE_ENV, str(cache))
    client, _ = stubbed_client()
    monkeypatch.setattr(boto3, "client", lambda *a, c=client, **k: c)
    result = runner.invoke(app, ["prices", "--refresh", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)  # the "cached ..." note goes to stderr
    assert json.loads(cache.read_text())["prices"]["ml.p4d.24xlarge"] == 37.688

    before = cache.read_text()
    client, _ = stubbed_client(error="AccessDeniedException")
    monkeypatch.setattr(boto3, "client", lambda *a, c=client, **k: c)
    result = runner.invoke(app, ["prices", "--refresh"])
    assert result.exit_code == 2
    assert "AccessDeniedException" in result.output and "Traceback" not in result.output
    assert cache.read_text() == before


def test_cli_instances(monkeypatch, tmp_path):
    monkeypatch.setenv(pricing.CACHE_ENV, str(tmp_path / "absent.json"))
    result = runner.invoke(app, ["instances", "--gpu", "V100", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert [r["name"] for r in rows] == ["ml.p3.2xlarge", "ml.p3.8xlarge", "ml.p3.16xlarge", "ml.p3dn.24xlarge"]
    assert not any(r["bf16"] or r["flash_attention"] for r in rows)
    assert runner.invoke(app, ["instances"]).exit_code == 0
    bad = runner.invoke(app, ["instances", "--gpu", "V1000"])
    assert bad.exit_code == 2 and "did you mean" in bad.output
