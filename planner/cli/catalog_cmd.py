"""`planner instances`: the SageMaker GPU instances the planner knows, with their GPUs and prices."""

from __future__ import annotations

from typing import Annotated

import typer

from planner.cli.common import JsonOpt, console, handles_errors
from planner.io import dumps_json

GpuOpt = Annotated[str | None, typer.Option("--gpu", help="Only instances with this GPU family or id, e.g. V100, A100-80GB.")]


def _row(name: str, cache: dict | None) -> dict[str, object]:
    from planner.aws.pricing import lookup
    from planner.hardware import get_instance, instance_table

    inst = get_instance(name)
    price, date, source = lookup(name, cache)
    extra = instance_table()[name]
    return {
        "name": name, "gpu": inst.gpu.name, "gpu_family": inst.gpu.family, "gpus": inst.gpus,
        "memory_per_gpu_gib": inst.gpu.memory_bytes / 2**30,
        "reported_memory_per_gpu_mib": (inst.gpu.reported_memory_bytes or 0) // 2**20 or None,
        "vcpus": inst.vcpus, "memory_gib": inst.memory_gib, "interconnect": inst.interconnect,
        "allreduce_bandwidth_gbs": inst.allreduce_bandwidth_gbs, "network_gbps": inst.network_gbps,
        "network": extra.get("network", ""), "efa": extra.get("efa", False),
        "bf16": inst.gpu.bf16, "flash_attention": inst.gpu.flash_attention,
        "usd_per_hour": price, "price_date": date, "price_source": source,
    }


@handles_errors
def instances(gpu: GpuOpt = None, json_out: JsonOpt = False) -> None:
    """List SageMaker training instances: GPU, count, memory per GPU, interconnect, bf16, flash, $/h."""
    from planner.aws.pricing import load_cache
    from planner.errors import unknown
    from planner.hardware import gpu_families, list_gpus, list_instances

    names = list_instances(gpu)
    if gpu is not None and not names:
        raise unknown("--gpu", gpu, gpu_families() + list_gpus())
    cache = load_cache()
    rows = [_row(n, cache) for n in names]
    if json_out:
        typer.echo(dumps_json(rows, indent=1))
        return
    from planner.cli.tables import Col, print_table

    cols = [Col("name", whole=True), Col("GPU", min=14), Col("GPUs", "right", whole=True),
            Col("memory/GPU", "right", whole=True), Col("GPU link"), Col("bf16"), Col("flash"),
            Col("$/h", "right", whole=True)]
    print_table(console, "SageMaker training instances", cols, [
        [str(r["name"]), str(r["gpu"]), str(r["gpus"]), f"{r['memory_per_gpu_gib']:.0f} GiB",
         str(r["interconnect"]).split(" (")[0], "yes" if r["bf16"] else "no",
         "yes" if r["flash_attention"] else "no", "-" if r["usd_per_hour"] is None else f"{r['usd_per_hour']:.3f}"]
        for r in rows])


def register(app: typer.Typer) -> None:
    app.command("instances")(instances)
