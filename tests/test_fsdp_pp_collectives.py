"""How often FSDP/HSDP gather parameters and reduce gradients per optimizer step under pipeline parallelism,
and HSDP's two groups (issue 34). The counts and ring volumes are written out here from the frameworks'
rules, not read back from the planner:

- FSDP2 under PP (torchtitan apply_fsdp: no reshard after forward when pp_enabled; torch.distributed.pipelining
  stage.py: no gradient sync and no reshard after backward before the last micro-batch): per step ONE
  all-gather of the stage's parameters and ONE reduce-scatter of its gradients; per micro-batch otherwise
  (forward all-gather, backward all-gather, reduce-scatter: 3 halves of an all-reduce each micro-batch);
- HSDP: reduce-scatter and all-gather over dp_shard (x cp), then an all-reduce of the 1/dp_shard gradient
  shard over dp_replicate;
- a ring all-gather / reduce-scatter moves (n-1)/n of the full bytes, an all-reduce 2(n-1)/n (nccl-tests).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from planner.hardware import get_instance
from planner.models.hf_config import spec_from_hf_config
from planner.parallel.dims import build
from planner.perf import model_parallel as mp
from planner.perf.throughput import ThroughputConstants, _sharded_dp_times, predict_throughput
from planner.spec import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
P5 = get_instance("ml.p5.48xlarge")
NO_LATENCY = ThroughputConstants(nccl_base_latency_s=0.0, nccl_hop_latency_nvlink_s=0.0,
                                 nccl_hop_latency_pci_s=0.0, nccl_hop_latency_net_s=0.0)


def cfg(**kw):
    base = dict(batch_size=1, seq_len=4096, precision="amp-bf16", attention="flash", parallelism="fsdp", tp=8, pp=4,
                instances=32, grad_accum=64)
    return TrainConfig(**{**base, **kw})


def dims_of(c: TrainConfig):
    return build(c, P5.gpus * c.instances, layers=80, heads=64, kv_heads=8, seq_len=c.seq_len)


@pytest.mark.parametrize("framework,parallelism,pp,expected", [
    ("pytorch", "fsdp", 4, True), ("torchtitan", "fsdp", 4, True), ("torchtitan", "hsdp", 2, True),
    ("pytorch", "fsdp", 1, False),  # no pipeline: the per-micro-batch rule stays (snapshot unchanged)
    ("pytorch", "zero3", 4, False),  # not FSDP2
    ("accelerate", "fsdp", 4, False),  # FSDP1: no pipelining integration
    ("pytorch", "ddp", 4, False),
])
def test_which_layouts_gather_once(framework, parallelism, pp, expected):
    c = SimpleNamespace(framework=framework, parallelism=parallelism)
    assert mp.fsdp_gathers_once(c, SimpleNamespace(pp=pp)) is expected


def _dp_total(c: TrainConfig, grad_bytes: int, param_bytes: int, units: int = 1) -> float:
    """Seconds of the step's DP collectives with nothing to hide behind (no compute given): total = exposed."""
    dims = dims_of(c)
    d_in, d_out, gbps = mp.dp_group_links(P5, dims)
    group = P5.model_copy(update={"gpus": d_in, "network_gbps": gbps})
    total, exposed = _sharded_dp_times(c, dims, P5, NO_LATENCY, grad_bytes, param_bytes, c.grad_accum, units,
                                       0.0, 0.0, group, d_out)
    assert exposed == pytest.approx(total)
    return total


@pytest.mark.parametrize("m", [4, 16, 64])
def test_fsdp2_under_pp_moves_one_gather_and_one_reduce_scatter_per_step(m):
    """Per micro-batch: m x (AG + AG + RS) = 3m halves; once per step: AG + RS = 2 halves (equal bytes)."""
    x = 10**9
    before = _dp_total(cfg(grad_accum=m, framework="accelerate"), x, x)  # FSDP1: the per-micro-batch rule
    after = _dp_total(cfg(grad_accum=m), x, x)
    assert before / after == pytest.approx(3 * m / 2)


def test_hsdp_reduces_in_the_shard_group_and_all_reduces_the_shard_across_replicas():
    """TP 8 on 8-GPU instances: every DP rank is on its own instance, each group's ring at one GPU's share of
    the network (b). FSDP over n = dp: ((n-1)/n P + (n-1)/n G) / b. HSDP (s shard ranks, r replicas):
    ((s-1)/s P + (s-1)/s G + 2 (r-1)/r G/s) / b."""
    P, G = 2 * 10**9, 4 * 10**9
    fsdp = _dp_total(cfg(), G, P)
    n = dims_of(cfg()).dp
    for r in (2, 4):
        hsdp = _dp_total(cfg(parallelism="hsdp", dp_replicas=r), G, P)
        s = n // r
        expected = ((s - 1) / s * P + (s - 1) / s * G + 2 * (r - 1) / r * G / s) / ((n - 1) / n * P + (n - 1) / n * G)
        assert hsdp / fsdp == pytest.approx(expected)


def test_hsdp_groups_sit_where_the_rank_order_puts_them():
    """dp_shard innermost after tp (and cp): with TP 2 on 8 GPUs, 4 shard ranks share an instance (NVLink, no
    network); the replicas are 8 ranks apart, on other instances. With TP 8 both groups cross instances."""
    c = cfg(tp=2, pp=1, instances=4, parallelism="hsdp", dp_replicas=4, grad_accum=1)
    d = dims_of(c)
    (s_in, s_out, _), (r_in, r_out, _) = mp.hsdp_groups(P5, d)
    assert (d.dp_shard, d.dp_replicate) == (4, 4)
    assert (s_in, s_out) == (4, 1) and (r_in, r_out) == (1, 4)
    d8 = dims_of(cfg(parallelism="hsdp", dp_replicas=2))
    (s_in, s_out, s_gbps), (r_in, r_out, r_gbps) = mp.hsdp_groups(P5, d8)
    assert (s_in, s_out, r_in, r_out) == (1, 4, 1, 2)
    assert s_gbps == r_gbps == pytest.approx(P5.network_gbps / P5.gpus)


@pytest.fixture(scope="module")
def llama70():
    return spec_from_hf_config(json.loads((ROOT / "tests/data/llama-3-70b.json").read_text()),
                               name="llama-3-70b")


def test_done_when_layout_speed_and_monotonic_in_micro_batches(llama70):
    """The Done-when layout: with the collectives once per step, the exposed DP time no longer grows with the
    micro-batches, and tokens/s per GPU does not fall as the global batch (micro-batches) grows."""
    rates, dp = [], []
    for m in (16, 32, 64):
        t = predict_throughput(llama70, cfg(vp=5, recompute="selective", recompute_modules=("core_attn",),
                                            grad_accum=m), P5)
        rates.append(t.tokens_per_s / t.gpus)
        dp.append(t.breakdown_s["dp_communication_s"])
    assert rates == sorted(rates)
    assert max(dp) == pytest.approx(min(dp), rel=0.05)


@pytest.mark.parametrize("framework,gather,grad", [
    ("pytorch", 4, 4),  # autocast: fp32 parameters gathered as they are, fp32 gradients
    ("torchtitan", 2, 4),  # MixedPrecisionPolicy(param bf16, reduce fp32): fp32 unsharded .grad under no-sync
])
def test_fsdp2_under_pp_holds_the_stage_unsharded(framework, gather, grad):
    """Memory: every stage holds its whole (TP-sharded) parameters in the gather dtype and their gradients in
    reduce dtype for the step, on top of its 1/dp shards; without PP nothing of the kind is added."""
    from planner.estimate import estimate

    config = TrainConfig(batch_size=1, seq_len=512, precision="amp-bf16", parallelism="fsdp", framework=framework,
                         grad_accum=4, pp=2, instances=2)
    held = estimate("llama-3-8b", config, "ml.p5.48xlarge", with_throughput=False, calibration={}).parallel
    for s in held.stages:
        assert s.unsharded_bytes == s.parameters * (gather + grad)
        assert s.parameter_bytes < s.parameters * gather  # the shards are reported apart
    flat = estimate("llama-3-8b", config.model_copy(update={"pp": 1, "tp": 2}), "ml.p5.48xlarge",
                    with_throughput=False, calibration={}).parallel
    assert all(s.unsharded_bytes == 0 for s in flat.stages)


def test_plain_hsdp_one_replica_is_fsdp_and_more_replicas_cross_the_network_less():
    """Without TP/PP: HSDP with one replica group is FSDP (no replicate all-reduce); with R groups of one
    instance each the gathers and reduce-scatters stay on NVLink and only the 1/8 gradient shard's all-reduce
    crosses the network, so the step's collective seconds fall as the groups shrink to one instance."""
    base = TrainConfig(batch_size=2, seq_len=1024, precision="amp-bf16", attention="flash", parallelism="fsdp",
                       instances=4, grad_accum=2)
    from planner.models.catalog import get_model

    model = get_model("llama-3-8b")
    fsdp = predict_throughput(model, base, P5).breakdown_s["communication_total_s"]
    totals = [predict_throughput(model, base.model_copy(update={"parallelism": "hsdp", "dp_replicas": r}), P5)
              .breakdown_s["communication_total_s"] for r in (1, 2, 4)]
    assert totals[0] == pytest.approx(fsdp)
    assert totals[0] > totals[1] > totals[2]


def test_fsdp1_no_sync_reduce_scatters_once_per_step():
    """Accelerate's FSDP1 accumulates under no_sync(): per step ga x (forward all-gather + backward all-gather)
    and ONE reduce-scatter, all three of equal bytes under its bf16 policy (gather and reduce in bf16): so
    T(2) - T(1) = two gathers = 2/3 T(1); PyTorch's FSDP2 loop reduce-scatters every micro-step: T(2) = 2 T(1)."""
    from planner.models.catalog import get_model

    model = get_model("llama-3-8b")
    base = TrainConfig(batch_size=1, seq_len=1024, precision="amp-bf16", attention="flash", parallelism="fsdp",
                       framework="accelerate", instances=2)

    def total(c):
        return predict_throughput(model, c, P5, NO_LATENCY).breakdown_s["communication_total_s"]

    t1, t2 = total(base), total(base.model_copy(update={"grad_accum": 2}))
    assert t2 - t1 == pytest.approx(2 / 3 * t1, rel=1e-6)
    torch_loop = base.model_copy(update={"framework": "pytorch"})
    assert total(torch_loop.model_copy(update={"grad_accum": 2})) == pytest.approx(2 * total(torch_loop), rel=1e-6)
