"""Speed of tensor, sequence, context and pipeline parallelism (issue 34 item 4) and the search over layouts
(item 5). Each rule is checked against the paper's formula written out here, not against the code's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.errors import PlannerError
from planner.hardware import get_instance
from planner.models.hf_config import spec_from_hf_config
from planner.parallel.dims import build
from planner.perf import model_parallel as mp
from planner.perf.throughput import ThroughputConstants, predict_throughput
from planner.spec import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
P5 = get_instance("ml.p5.48xlarge")
NO_LATENCY = ThroughputConstants(nccl_base_latency_s=0.0, nccl_hop_latency_nvlink_s=0.0,
                                 nccl_hop_latency_pci_s=0.0, nccl_hop_latency_net_s=0.0)


def gpt(hidden=2048, layers=16, heads=16, vocab=32768, positions=4096):
    cfg = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": hidden, "n_layer": layers,
           "n_head": heads, "vocab_size": vocab, "n_positions": positions, "tie_word_embeddings": False}
    return spec_from_hf_config(cfg, name=f"gpt-{hidden}-{layers}")


def cfg(**kw):
    base = dict(batch_size=1, seq_len=2048, precision="amp-bf16", attention="flash", parallelism="ddp")
    return TrainConfig(**{**base, **kw})


# ---- pipeline bubble: Narayanan et al. 2021 §2.2 -------------------------------------------------------


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 64), (16, 64)])
def test_bubble_is_narayanans(p, m):
    assert mp.bubble_fraction("1f1b", p, m) == pytest.approx((p - 1) / m)
    assert mp.bubble_fraction("gpipe", p, m) == pytest.approx((p - 1) / m)  # same bubble, more memory
    for v in (2, 4):
        assert mp.bubble_fraction("interleaved-1f1b", p, m, v) == pytest.approx((p - 1) / (v * m))
    assert mp.bubble_fraction("zero-bubble", p, m) == 0.0
    assert mp.bubble_fraction("1f1b", 1, m) == 0.0


def test_bubble_shrinks_with_micro_batches_and_virtual_stages():
    fr = [mp.bubble_fraction("1f1b", 8, m) for m in (8, 16, 32, 64)]
    assert fr == sorted(fr, reverse=True) and fr[-1] < fr[0]
    assert mp.bubble_fraction("interleaved-1f1b", 8, 16, 4) < mp.bubble_fraction("interleaved-1f1b", 8, 16, 2) \
        < mp.bubble_fraction("1f1b", 8, 16)


def test_unknown_schedule_is_one_clear_error():
    with pytest.raises(PlannerError, match="pp-schedule"):
        mp.bubble_fraction("dualpipe", 4, 8)


# ---- tensor parallelism: Shoeybi et al. 2019, Korthikanti et al. 2022 ----------------------------------


def shape(hidden=8192, layers=80, kv=1024, head_dim=128):
    return mp.LayerShape(hidden=hidden, kv_width=kv, head_dim=head_dim, layers=layers, elem_bytes=2)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tp_forward_is_two_ring_allreduces_of_the_layer_output(tp):
    b, s, h = 1, 4096, 8192
    bus = P5.allreduce_bandwidth_gbs * 1e9
    # two all-reduces of b*s*h 16-bit values; a ring all-reduce moves 2(t-1)/t of them per GPU
    expected = 2 * (2 * (tp - 1) / tp * b * s * h * 2 / bus)
    got = mp.tp_seconds_per_layer(b, s, shape(h), tp, 1, False, P5, NO_LATENCY)
    assert got == pytest.approx(expected)
    # sequence parallelism: all-gather + reduce-scatter in place of each all-reduce, the same bytes
    assert mp.tp_seconds_per_layer(b, s, shape(h), tp, 1, True, P5, NO_LATENCY) == pytest.approx(expected)
    # with latency, SP issues twice the calls
    with_lat = ThroughputConstants()
    assert (mp.tp_seconds_per_layer(b, s, shape(h), tp, 1, True, P5, with_lat)
            > mp.tp_seconds_per_layer(b, s, shape(h), tp, 1, False, P5, with_lat))


def test_tp_collectives_count_forward_backward_and_recompute():
    one = 1e-3
    assert mp.tp_exposed_s(one, 10, 2) == pytest.approx(2 * 10 * one)  # 2 in forward, 2 in backward (f, g)
    assert mp.tp_exposed_s(one, 10, 3) == pytest.approx(3 * 10 * one)  # + a recomputed forward
    assert mp.tp_exposed_s(one, 10, 2, tp_overlap=0.5) == pytest.approx(10 * one)


def test_tp_beyond_one_instance_is_refused():
    with pytest.raises(PlannerError, match="--tp"):
        mp.tp_group_bus_gbs(P5, 16)


# ---- pipeline sends: Megatron-Core get_tensor_shapes -----------------------------------------------------


def test_p2p_bytes_are_the_sequence_shard_of_one_micro_batch():
    b, s, h = 2, 4096, 8192
    assert mp.p2p_bytes(b, s, shape(h), 8, 1, False) == b * s * h * 2
    assert mp.p2p_bytes(b, s, shape(h), 8, 1, True) == b * (s // 8) * h * 2  # / tp with SP
    assert mp.p2p_bytes(b, s, shape(h), 8, 2, True) == b * (s // 16) * h * 2  # / cp too


# ---- context parallelism: ring exchange of K/V overlapped with attention ----------------------------------


def test_cp_ring_hides_behind_long_attention_and_shows_behind_short():
    kv = mp.cp_kv_bytes(1, 32768, shape(), 8, 4)
    assert kv == 2 * 1 * (32768 // 4) * (1024 // 8) * 2  # K and V of s/cp tokens, kv heads / tp
    link = 100.0
    send = kv / (link * 1e9)
    total, exposed = mp.cp_exposed_s(kv, 4, link, attention_forward_s=1.0, attention_backward_s=2.0, layers=10)
    assert total == pytest.approx(3 * 3 * send * 10) and exposed == 0.0
    total, exposed = mp.cp_exposed_s(kv, 4, link, attention_forward_s=0.0, attention_backward_s=0.0, layers=10)
    assert exposed == pytest.approx(total)


# ---- data parallelism over model-parallel groups ----------------------------------------------------------


def test_dp_group_links():
    plain = build(cfg(instances=4), 32)
    assert mp.dp_group_links(P5, plain) == (8, 4, P5.network_gbps)  # the whole instance, as before
    tp8 = build(cfg(instances=4, tp=8), 32)
    d_in, d_out, gbps = mp.dp_group_links(P5, tp8)
    assert (d_in, d_out) == (1, 4) and gbps == pytest.approx(P5.network_gbps / 8)  # one GPU's share
    tp2 = build(cfg(instances=4, tp=2), 32)
    assert mp.dp_group_links(P5, tp2)[:2] == (4, 4)
    # context-parallel ranks hold the same weights: their gradients reduce with the data-parallel ones
    tp4cp2 = build(cfg(instances=4, tp=4, cp=2), 32)
    assert mp.dp_cp_ranks(tp4cp2) == 8 and mp.dp_group_links(P5, tp4cp2)[:2] == (2, 4)


# ---- the step ---------------------------------------------------------------------------------------------


def test_unsplit_layout_is_the_data_parallel_model():
    model = gpt()
    a = predict_throughput(model, cfg(instances=2), P5)
    b = predict_throughput(model, cfg(instances=2, tp=1, cp=1, pp=1), P5)
    assert a == b
    assert "tp_communication_s" not in a.breakdown_s


def test_more_tp_means_less_compute_per_gpu():
    model = gpt(hidden=4096, layers=8, heads=32)
    compute = [predict_throughput(model, cfg(tp=t), P5).breakdown_s["compute_s"] for t in (1, 2, 4, 8)]
    assert all(a > b for a, b in zip(compute, compute[1:], strict=False))
    tp_comm = [predict_throughput(model, cfg(tp=t), P5).breakdown_s["tp_communication_s"] for t in (2, 4, 8)]
    assert all(x > 0 for x in tp_comm)


def test_bubble_share_shrinks_with_micro_batches():
    model = gpt()
    share = []
    for m in (4, 8, 16, 32):
        t = predict_throughput(model, cfg(pp=4, grad_accum=m), P5)
        share.append(t.breakdown_s["pp_bubble_s"] / t.step_time_s)
    assert share == sorted(share, reverse=True)
    one = predict_throughput(model, cfg(pp=4, grad_accum=8), P5)
    inter = predict_throughput(model, cfg(pp=4, vp=2, grad_accum=8), P5)
    assert inter.breakdown_s["pp_bubble_s"] < one.breakdown_s["pp_bubble_s"]
    zb = predict_throughput(model, cfg(pp=4, grad_accum=8, pp_schedule="zero-bubble"), P5)
    assert zb.breakdown_s["pp_bubble_s"] == 0.0


def test_breakdown_kinds_sum_to_the_step():
    t = predict_throughput(gpt(), cfg(tp=2, pp=2, grad_accum=8, instances=2), P5)
    kinds = ("gemm", "attention", "memory_bound", "optimizer", "communication", "launch_overhead")
    assert sum(t.breakdown_s[k] for k in kinds) == pytest.approx(t.step_time_s)


def test_mfu_is_megatrons_model_flops():
    """MFU = 72·B·s·L·h²·(1 + s/(6h) + V/(12·L·h)) per step (Narayanan et al. 2021 eq. 3 without recompute;
    Megatron-LM training.py num_floating_point_operations for a GPT) / (step · GPUs · dense BF16 peak)."""
    h, L, a, V, s, b, m = 2048, 16, 16, 32768, 2048, 1, 8
    model = gpt(hidden=h, layers=L, heads=a, vocab=V, positions=s)
    t = predict_throughput(model, cfg(tp=2, pp=2, grad_accum=m, instances=2, seq_len=s), P5)
    dp = 16 // 4
    flops = 72 * (b * m * dp) * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    assert t.mfu == pytest.approx(flops / (t.step_time_s * 16 * P5.gpu.peak_tflops["bf16"] * 1e12), rel=1e-3)
    assert t.gpus == 16 and t.tokens_per_s_per_gpu == pytest.approx(t.tokens_per_s / 16)
    assert t.global_batch_size == b * m * dp


def test_tp_beyond_the_instance_is_refused_in_an_estimate():
    with pytest.raises(PlannerError, match="--tp"):
        predict_throughput(gpt(heads=16), cfg(tp=16, instances=2), P5)


def test_tokens_per_gpu_in_json():
    t = predict_throughput(gpt(), cfg(instances=2), P5)
    assert json.loads(t.model_dump_json())["tokens_per_s_per_gpu"] == pytest.approx(t.tokens_per_s / 16)


# ---- search ----------------------------------------------------------------------------------------------


def test_search_space_of_a_70b_model_has_valid_layouts_only():
    from planner.models.catalog import get_model
    from planner.search.space import SpaceSpec, resolve_space

    model = get_model(str(ROOT / "tests" / "data" / "llama-3-70b.json"))
    space = resolve_space(SpaceSpec(instance_counts=(1, 2, 4)), model, [P5], global_batch_size=64)
    assert space.tp_sizes == (1, 2, 4, 8)  # divide 8 GPUs, 64 heads, and 8 kv heads
    assert space.pp_sizes == (1, 2, 4, 5, 8, 10, 16)  # divide 80 layers
    assert "dp" not in space.parallelisms
    bad = space.point({"instance": P5.name, "instances": 1, "tp": 8, "pp": 4, "batch_size": 1, "seq_len": 512,
                       "parallelism": "fsdp"})
    assert bad.config is None and "divides" in bad.reason
    good = space.point({"instance": P5.name, "instances": 4, "tp": 8, "pp": 2, "batch_size": 1, "seq_len": 512,
                        "parallelism": "fsdp"})
    assert good.config is not None and good.config.grad_accum == 64 // 2  # over dp = 32 / 16 = 2 replicas


def test_default_search_space_of_a_small_model_is_unchanged():
    from planner.models.catalog import get_model
    from planner.search.space import SpaceSpec, resolve_space

    space = resolve_space(SpaceSpec(), get_model("bert-base-uncased"), [get_instance("ml.p3.16xlarge")])
    assert (space.tp_sizes, space.pp_sizes, space.cp_sizes) == ((1,), (1,), (1,))
    assert "tp" not in space.searched() and "tp" not in space.constants()


def test_a_traced_models_table_refuses_model_parallelism():
    from planner.perf.roofline import kernel_table
    from planner.perf.throughput import table_throughput

    model = gpt()
    table = kernel_table(model, cfg(), flash_ok=True)
    with pytest.raises(PlannerError, match="traced model"):
        table_throughput(table, 10**9, 100, 2048, cfg(tp=2), P5)  # no layout record: what a traced model passes


def test_search_best_line_names_the_layout_and_its_replicas():
    from planner.cli.search_cmd import best_lines

    row = {"instance": "ml.p5.48xlarge", "instances": 32, "world_size": 256, "batch_size": 1, "grad_accum": 64,
           "global_batch_size": 512, "seq_len": 4096, "precision": "amp-bf16", "checkpointing": False,
           "parallelism": "zero1", "attention": "flash", "optimizer": "adamw", "optimizer_impl": "fused",
           "tp": 8, "pp": 4, "cp": 1, "samples_per_s": 12.0, "hours_per_job": 1.0, "usd_per_job": 10.0,
           "price_per_hour": 100.0, "peak_device_gib": 60.0, "gpu_memory_gib": 80.0, "verdict": "fits",
           "peak_device_high_gib": 70.0}
    text = "\n".join(best_lines(row, "hours_per_job", "usd_per_job", True))
    assert "x 8 replicas = global batch 512" in text and "tp 8 x pp 4 (256 GPUs)" in text
    assert all(len(line) <= 80 for line in text.splitlines())


def test_throughput_record_reads_back_its_dump():
    from planner.spec import Throughput

    t = predict_throughput(gpt(), cfg(tp=2, instances=2), P5)
    assert Throughput.model_validate(t.model_dump()) == t
    assert Throughput.model_validate_json(t.model_dump_json()).tokens_per_s_per_gpu == t.tokens_per_s_per_gpu
