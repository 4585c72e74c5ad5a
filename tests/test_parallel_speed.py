"""Why ZeRO-3, FSDP and DataParallel differ in speed from DDP and ZeRO-2 (issue 24, item 4): the mechanisms,
each checked against its formula from the instance's own figures, never against a figure the model printed."""

from __future__ import annotations

import pytest

from planner.hardware import get_instance
from planner.models.catalog import get_model
from planner.perf.collectives import nccl_latency_s, overlap_contention_s, prefetch_hidden
from planner.perf.throughput import (
    PARAM_BYTES,
    ThroughputConstants,
    parameter_counts,
    predict_throughput,
    shard_units,
)
from planner.spec import TrainConfig

GB = 1e9
BERT_LARGE = get_model("bert-large-uncased")
P3_8X, P3_16X = get_instance("ml.p3.8xlarge"), get_instance("ml.p3.16xlarge")
NO_LATENCY = {"nccl_base_latency_s": 0.0, "nccl_hop_latency_nvlink_s": 0.0, "nccl_hop_latency_pci_s": 0.0,
              "nccl_hop_latency_net_s": 0.0}


def tput(parallelism, instance=P3_16X, constants=None, model=BERT_LARGE, **cfg):
    cfg = {"batch_size": 8, "seq_len": 512, "precision": "amp-fp16", **cfg}
    return predict_throughput(model, TrainConfig(parallelism=parallelism, **cfg), instance, constants)


def half_ring_s(instance, precision="amp-fp16", model=BERT_LARGE):
    """One all-gather or reduce-scatter of every parameter: (g-1)/g x bytes / bus bandwidth."""
    g = instance.gpus
    n_params, _ = parameter_counts(model)
    return (g - 1) / g * n_params * PARAM_BYTES[precision] / (instance.allreduce_bandwidth_gbs * GB)


@pytest.mark.parametrize("ga", [1, 3])
def test_bytes_moved_equal_the_formula_from_the_sharded_sizes(ga):
    """Without NCCL's per-call latency the collectives' seconds are their ring volume over the bus bandwidth:
    ZeRO-3/FSDP 3 halves of an all-reduce per micro-step (all-gather forward, all-gather backward,
    reduce-scatter), ZeRO-2 one reduce-scatter per micro-step + one all-gather per step, DDP one all-reduce
    per step; with one micro-step ZeRO-2 moves exactly DDP's volume."""
    c = ThroughputConstants(**NO_LATENCY)
    h = half_ring_s(P3_16X)
    for p in ("zero3", "fsdp"):
        total = tput(p, constants=c, grad_accum=ga).breakdown_s["communication_total_s"]
        assert total == pytest.approx(3 * ga * h, rel=1e-9)
    assert tput("zero2", constants=c, grad_accum=ga).breakdown_s["communication_total_s"] == pytest.approx(
        (ga + 1) * h, rel=1e-9)
    assert tput("ddp", constants=c, grad_accum=ga).breakdown_s["communication_total_s"] == pytest.approx(
        2 * h, rel=1e-9)


def test_nothing_hidden_means_every_collective_is_exposed():
    """shard_overlap = 0: the per-unit collectives add their whole time to the step; overlap 1 hides all
    but the first unit of each phase (never more than the phase's compute), and the hidden part slows compute
    by the SMs NCCL's blocks hold: channels / SMs of it (V100: 8 channels on 80 SMs)."""
    none = tput("fsdp", constants=ThroughputConstants(shard_overlap=0.0)).breakdown_s
    assert none["communication_s"] == pytest.approx(none["communication_total_s"], rel=1e-12)
    full = tput("fsdp", constants=ThroughputConstants(shard_overlap=1.0)).breakdown_s
    units = shard_units("fsdp", parameter_counts(BERT_LARGE)[1], 24)
    total = full["communication_total_s"]
    hidden = total - total / units
    share = P3_16X.gpu.nccl_channels / P3_16X.gpu.sm_count
    assert share == pytest.approx(8 / 80)
    assert full["communication_s"] == pytest.approx(total / units + hidden * share, rel=1e-9)


def test_prefetch_hides_no_more_than_the_compute_beside_it():
    """Unit by unit: u + (n-1) max(u, v) + v. Collectives longer than the compute of the units they are
    prefetched beside expose what the compute cannot cover; shorter ones hide all but the first unit's."""
    c = ThroughputConstants()
    assert prefetch_hidden(10.0, 10, 100.0, c) == pytest.approx(9.0)  # compute-bound: all but unit 1
    assert prefetch_hidden(10.0, 10, 4.0, c) == pytest.approx(4.0)  # comm-bound: the compute's length
    assert prefetch_hidden(10.0, 1, 100.0, c) == 0.0  # one unit: nothing to prefetch beside
    assert overlap_contention_s(1.0, get_instance("ml.p4d.24xlarge")) == pytest.approx(16 / 108)


@pytest.mark.parametrize("p", ["zero3", "fsdp"])
@pytest.mark.parametrize("ga", [1, 4])
def test_zero3_and_fsdp_differ_from_zero2_by_their_exposed_communication(p, ga):
    """Same compute and the same 1/n optimizer shard as ZeRO-2, so the steps differ by the exposed
    communication alone; ZeRO-3/FSDP expose at least the first unit's collective of each of the 3 phases of
    every micro-step (nothing to prefetch it beside)."""
    c = ThroughputConstants(**NO_LATENCY)
    z2, z3 = tput("zero2", grad_accum=ga, constants=c), tput(p, grad_accum=ga, constants=c)
    diff = z3.step_time_s - z2.step_time_s
    assert diff == pytest.approx(z3.breakdown_s["communication_s"] - z2.breakdown_s["communication_s"], rel=1e-9)
    units = shard_units(p, parameter_counts(BERT_LARGE)[1], 24)
    first_units = 3 * ga * half_ring_s(P3_16X) / units
    assert z3.breakdown_s["communication_s"] >= first_units * (1 - 1e-9)


def test_zero3_pays_nccl_latency_per_sub_module_fsdp_per_layer():
    """ZeRO-3 fetches each sub-module, FSDP each wrapped layer: the gap in their collectives' total is the
    extra NCCL calls x NCCL's latency per call, the bytes being the same."""
    n_tensors = parameter_counts(BERT_LARGE)[1]
    z3, fsdp = tput("zero3").breakdown_s, tput("fsdp").breakdown_s
    extra_calls = shard_units("zero3", n_tensors, 24) - shard_units("fsdp", n_tensors, 24)
    assert extra_calls > 100
    lat = nccl_latency_s("fsdp_all_gather", P3_16X, 1, ThroughputConstants())
    assert z3["communication_total_s"] - fsdp["communication_total_s"] == pytest.approx(3 * extra_calls * lat,
                                                                                          rel=1e-9)


def test_nccl_latency_follows_the_ring_steps():
    """All-reduce rings take 2(n-1) steps, all-gather n-1 (NCCL tuning.cc); PCIe hops cost more than NVLink."""
    c = ThroughputConstants()
    ar = nccl_latency_s("allreduce", P3_16X, 1, c) - c.nccl_base_latency_s
    ag = nccl_latency_s("all_gather", P3_16X, 1, c) - c.nccl_base_latency_s
    assert ar == pytest.approx(2 * ag) and ag == pytest.approx(7 * c.nccl_hop_latency_nvlink_s)
    g5 = get_instance("ml.g5.12xlarge")  # 4 A10G on PCIe
    assert nccl_latency_s("all_gather", g5, 1, c) == pytest.approx(c.nccl_base_latency_s + 3 * c.nccl_hop_latency_pci_s)
    two = nccl_latency_s("allreduce", P3_16X, 2, c) - c.nccl_base_latency_s  # 16 ranks, 2 of the steps cross
    assert two == pytest.approx(28 * c.nccl_hop_latency_nvlink_s + 2 * c.nccl_hop_latency_net_s)


def test_dataparallel_moves_the_parameters_twice_through_gpu0_every_micro_step():
    """replicate() broadcasts the parameters and backward reduces the gradients onto GPU 0, each at the bus
    bandwidth, not overlapped, every micro-step; plus flatten copies and the inputs/outputs through GPU 0."""
    c = ThroughputConstants(**NO_LATENCY)
    n_params, _ = parameter_counts(BERT_LARGE)
    nbytes = n_params * PARAM_BYTES["amp-fp16"]
    copies = 2 * nbytes / (P3_16X.allreduce_bandwidth_gbs * GB)
    flatten = 4 * nbytes / (P3_16X.gpu.memory_bandwidth_gbs * GB * c.hbm_efficiency)
    for ga in (1, 2):
        b = tput("dp", constants=c, grad_accum=ga).breakdown_s
        assert b["communication_s"] == pytest.approx(b["communication_total_s"], rel=1e-12)  # nothing hidden
        assert b["communication_s"] > ga * (copies + flatten + c.dp_replicate_overhead_s)


def test_dataparallel_is_slower_than_ddp_and_more_so_on_more_gpus():
    """DDP's all-reduce hides behind backward and runs once per step; DataParallel's copies go through GPU 0
    (the outputs of every other replica) and its forward dispatch is one GIL: its gap over DDP grows with
    the GPU count (same GPU, V100, on 4 and 8)."""
    for model, b in ((BERT_LARGE, 8), (get_model("bert-base-uncased"), 2)):
        ratio = [tput("dp", inst, model=model, batch_size=b).step_time_s
                 / tput("ddp", inst, model=model, batch_size=b).step_time_s for inst in (P3_8X, P3_16X)]
        assert 1 < ratio[0] < ratio[1]


def test_dataparallel_forward_dispatch_is_serialised_by_the_gil():
    """At a micro-batch small enough for the host to bound the step, each more replica adds its forward ops'
    host time; with no GIL share the launch overhead is DDP's."""
    base = get_model("bert-base-uncased")
    free = tput("dp", model=base, batch_size=1, constants=ThroughputConstants(dp_gil_share=0.0))
    gil = tput("dp", model=base, batch_size=1)
    ddp = tput("ddp", model=base, batch_size=1)
    assert free.breakdown_s["launch_overhead"] == pytest.approx(ddp.breakdown_s["launch_overhead"], rel=1e-9)
    assert gil.breakdown_s["launch_overhead"] > 2 * ddp.breakdown_s["launch_overhead"]


@pytest.mark.parametrize("p", ["dp", "zero3", "fsdp"])
def test_the_slowest_gpu_wait_applies_to_every_strategy(p):
    """Every synchronous data-parallel step waits for its slowest GPU: the same wait on the same compute."""
    ddp, other = tput("ddp").breakdown_s, tput(p).breakdown_s
    assert other["slowest_gpu_wait_s"] > 0
    if p != "dp":  # the same compute as DDP (DataParallel's host dispatch may lengthen its micro-step)
        assert other["slowest_gpu_wait_s"] == pytest.approx(ddp["slowest_gpu_wait_s"], rel=1e-12)
    one = tput(p, instance=get_instance("ml.p3.2xlarge")).breakdown_s
    assert one["slowest_gpu_wait_s"] == 0.0 and one["communication_total_s"] == 0.0
