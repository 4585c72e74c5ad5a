"""`prices --refresh` without AWS credentials: the public Price List bulk offer files (service index → region
index → the region's offer file), served from 127.0.0.1 in the real files' layout; with credentials the API."""

from __future__ import annotations

import http.server
import json
import threading

import boto3
import pytest
from typer.testing import CliRunner

from planner.aws import pricing
from planner.cli.main import app

runner = CliRunner()
VERSION = "20241101000000"


def _product(sku: str, instance: str, component: str, usage: str) -> dict:
    # the attributes an AmazonSageMaker offer file gives a training SKU (usage type USE1-Train:<instance>)
    return {"sku": sku, "productFamily": "ML Instance", "attributes": {
        "servicecode": "AmazonSageMaker", "location": "US East (N. Virginia)", "locationType": "AWS Region",
        "instanceType": f"{instance}-{component}", "usagetype": f"{usage}:{instance}", "operation": "RunInstance",
        "component": component, "regionCode": "us-east-1", "servicename": "Amazon SageMaker"}}


def _terms(sku: str, usd: str, unit: str = "Hrs") -> dict:
    code = f"{sku}.JRTCKXETXF"
    return {code: {"offerTermCode": "JRTCKXETXF", "sku": sku, "effectiveDate": "2024-11-01T00:00:00Z",
                   "priceDimensions": {f"{code}.6YS6EN2CT7": {
                       "rateCode": f"{code}.6YS6EN2CT7", "description": f"${usd} per hour", "beginRange": "0",
                       "endRange": "Inf", "unit": unit, "pricePerUnit": {"USD": usd}, "appliesTo": []}},
                   "termAttributes": {}}}


OFFER = {
    "formatVersion": "v1.0", "disclaimer": "...", "offerCode": "AmazonSageMaker", "version": VERSION,
    "publicationDate": "2024-11-01T00:00:00Z",
    "products": {"AAA": _product("AAA", "ml.p3.16xlarge", "Training", "USE1-Train"),
                 "BBB": _product("BBB", "ml.g5.2xlarge", "Training", "USE1-Train"),
                 "CCC": _product("CCC", "ml.g5.2xlarge", "Hosting", "USE1-Host"),
                 "DDD": _product("DDD", "ml.p4d.24xlarge", "Training", "USE1-Train")},
    "terms": {"OnDemand": {"AAA": _terms("AAA", "28.1520000000"), "BBB": _terms("BBB", "1.5150000000"),
                           "CCC": _terms("CCC", "1.2120000000"), "DDD": _terms("DDD", "0.0000000000")}},
}
FILES = {
    "/offers/v1.0/aws/index.json": {"formatVersion": "v1.0", "publicationDate": "2024-11-01T00:00:00Z", "offers": {
        "AmazonSageMaker": {"offerCode": "AmazonSageMaker",
                            "currentVersionUrl": "/offers/v1.0/aws/AmazonSageMaker/current/index.json",
                            "currentRegionIndexUrl": "/offers/v1.0/aws/AmazonSageMaker/current/region_index.json"}}},
    "/offers/v1.0/aws/AmazonSageMaker/current/region_index.json": {"formatVersion": "v1.0", "regions": {
        "us-east-1": {"regionCode": "us-east-1",
                      "currentVersionUrl": f"/offers/v1.0/aws/AmazonSageMaker/{VERSION}/us-east-1/index.json"}}},
    f"/offers/v1.0/aws/AmazonSageMaker/{VERSION}/us-east-1/index.json": OFFER,
}


@pytest.fixture
def server():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = FILES.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            if body is not None:
                self.wfile.write(json.dumps(body).encode())

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()


def _no_credentials(monkeypatch):
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def test_refresh_without_credentials_reads_the_offer_files(server, tmp_path, monkeypatch):
    _no_credentials(monkeypatch)
    cache = tmp_path / "prices.json"
    monkeypatch.setenv(pricing.CACHE_ENV, str(cache))
    monkeypatch.setenv(pricing.BULK_ENV, server)
    r = runner.invoke(app, ["prices", "--refresh", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(cache.read_text())["regions"]["us-east-1"]
    assert data["prices"] == {"ml.p3.16xlarge": 28.152, "ml.g5.2xlarge": 1.515}  # hosting and $0 skipped
    assert data["source"].startswith(pricing.BULK_SOURCE) and "published 2024-11-01" in data["source"]
    rows = {row["instance"]: row for row in json.loads(r.stdout)}
    assert rows["ml.g5.2xlarge"]["usd_per_hour"] == 1.515 and "bulk offer file" in rows["ml.g5.2xlarge"]["source"]
    # the estimate then names this price's source and date
    est = runner.invoke(app, ["estimate", "--model", "gpt2", "--instance", "ml.g5.2xlarge", "--batch-size", "2",
                              "--seq-len", "128"])
    assert "AWS Price List bulk offer file" in est.stdout, est.output


def test_an_unknown_region_or_a_dead_server_is_one_line_and_leaves_the_cache(server, tmp_path, monkeypatch):
    _no_credentials(monkeypatch)
    cache = tmp_path / "prices.json"
    cache.write_text('{"prices": {"ml.g5.2xlarge": 1.0}}')
    monkeypatch.setenv(pricing.CACHE_ENV, str(cache))
    monkeypatch.setenv(pricing.BULK_ENV, server)
    r = runner.invoke(app, ["prices", "--refresh", "--region", "eu-west-1"])
    assert r.exit_code == 2 and "region index lists no offer file" in r.output and "Traceback" not in r.output
    monkeypatch.setenv(pricing.BULK_ENV, "http://127.0.0.1:9")  # nothing listens: refused at once
    r = runner.invoke(app, ["prices", "--refresh"])
    assert r.exit_code == 2 and "unreachable" in r.output
    assert json.loads(cache.read_text()) == {"prices": {"ml.g5.2xlarge": 1.0}}


def test_with_credentials_the_api_answers_not_the_offer_files(monkeypatch, tmp_path):
    from tests.test_pricing import stubbed_client

    client, _ = stubbed_client()
    monkeypatch.setattr(boto3, "client", lambda *a, c=client, **k: c)
    monkeypatch.setenv(pricing.BULK_ENV, "http://127.0.0.1:9")  # would fail if read
    path, count = pricing.refresh("us-east-1", tmp_path / "p.json")
    assert count == 3 and "get_products" in json.loads(path.read_text())["source"]
