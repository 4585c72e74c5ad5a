"""planner.parallel.dims: the layout record of issue 34, checked once (degrees multiply to the world and divide
what they split), and planner.memory.stages: what each rank holds."""

from __future__ import annotations

import math

import pytest

from planner.errors import PlannerError
from planner.memory import stages as st
from planner.parallel.dims import build, check_attention
from planner.spec import TrainConfig

LLAMA70 = {"layers": 80, "heads": 64, "kv_heads": 8, "seq_len": 4096, "ffn": 28672}


def cfg(**kw) -> TrainConfig:
    return TrainConfig(batch_size=1, seq_len=4096, **kw)


def test_done_when_layout():
    d = build(cfg(tp=8, pp=4, vp=5, parallelism="fsdp", instances=32, grad_accum=64), 256, **LLAMA70)
    assert (d.dp, d.dp_shard, d.dp_replicate, d.tp, d.pp, d.vp, d.sp) == (8, 8, 1, 8, 4, 5, True)
    assert d.schedule == "interleaved-1f1b" and d.dp * d.model_parallel == d.world
    assert d.micro_batches(512, 1) == 64


def test_defaults_are_plain():
    d = build(cfg(), 8, **LLAMA70)
    assert d.plain and d.dp == 8 and d.schedule == "none" and not d.sp


def test_hsdp_replicas_split_the_data_parallel_group():
    d = build(cfg(parallelism="hsdp", dp_replicas=4), 32)
    assert (d.dp_replicate, d.dp_shard, d.dp) == (4, 8, 32)


@pytest.mark.parametrize("kw, world, flag", [
    ({"tp": 3}, 8, "--tp/--cp/--pp"),                      # does not divide the world
    ({"tp": 16}, 16, "--tp"),                               # 64 heads yes, 8 kv heads: a multiple, fine -> ffn
    ({"pp": 3}, 24, "--pp/--vp"),                           # 80 layers over 3 stages
    ({"pp": 4, "vp": 3}, 8, "--pp/--vp"),                   # 80 over 12 chunks
    ({"pp": 8, "vp": 11}, 8, "--pp"),                       # 88 stages × chunks > 80 layers
    ({"vp": 2}, 8, "--vp"),                                 # virtual stages without a pipeline
    ({"pp_schedule": "1f1b"}, 8, "--pp-schedule"),          # a schedule without a pipeline
    ({"pp": 2, "pp_schedule": "interleaved-1f1b"}, 8, "--pp-schedule"),  # interleaving one chunk
    ({"pp": 2, "vp": 2, "pp_schedule": "gpipe"}, 8, "--pp-schedule"),    # gpipe has no virtual stages
    ({"parallelism": "hsdp", "dp_replicas": 3}, 8, "--dp-replicas"),
    ({"parallelism": "fsdp", "dp_replicas": 2}, 8, "--dp-replicas"),   # replicas only with hsdp
    ({"sp": True}, 8, "--sp"),
    ({"pp": 4, "vp": 2, "grad_accum": 6}, 8, "--grad-accum"),  # interleaving needs m % pp == 0                              # sequence parallelism without TP
    ({"tp": 2, "cp": 4}, 8, "--seq-len"),                   # 4096 % (2·4·2) = 0: ok -> see below
])
def test_rules(kw, world, flag):
    if kw == {"tp": 2, "cp": 4}:  # the load-balanced CP rule: 4100 is no multiple of tp·cp·2 = 16
        with pytest.raises(PlannerError) as e:
            build(cfg(**kw), world, **(LLAMA70 | {"seq_len": 4100}))
    elif kw == {"tp": 16}:
        with pytest.raises(PlannerError) as e:
            build(cfg(**kw), world, **(LLAMA70 | {"ffn": 28680}))
    else:
        with pytest.raises(PlannerError) as e:
            build(cfg(**kw), world, **LLAMA70)
    assert e.value.field == flag


def test_kv_heads_divided_or_replicated():
    build(cfg(tp=16), 16, **LLAMA70)  # 8 kv heads, tp 16: each rank one replicated head (Megatron)
    with pytest.raises(PlannerError):
        build(cfg(tp=16), 16, **(LLAMA70 | {"kv_heads": 6}))  # neither divides the other
    assert st.kv_heads_per_rank(8, 16) == 1 and st.kv_heads_per_rank(8, 4) == 2


def test_context_parallel_needs_an_sdpa_kernel():
    d = build(cfg(cp=2), 8, **LLAMA70)
    check_attention(d, "sdpa", "pytorch")
    for kernel in ("eager", "flash"):
        with pytest.raises(PlannerError) as e:
            check_attention(d, kernel, "pytorch")
        assert e.value.field == "--attention"
    check_attention(d, "flash", "megatron")  # Transformer Engine's attention runs CP
    with pytest.raises(PlannerError):
        check_attention(d, "eager", "megatron")


def test_recompute_modules_only_with_selective():
    with pytest.raises(PlannerError) as e:
        build(cfg(recompute_modules=("core_attn",)), 8)
    assert e.value.field == "--recompute-modules"
    build(cfg(recompute="selective", recompute_modules="core_attn,mlp"), 8)


def test_recompute_and_checkpointing_are_one_answer():
    assert cfg(recompute="full").checkpointing and cfg(recompute="full").recompute_mode == "full"
    assert cfg(checkpointing=True).recompute_mode == "full"
    assert cfg(recompute="none").recompute_mode == "none" and not cfg(recompute="none").checkpointing
    assert cfg(recompute="selective").recompute_mode == "selective"
    with pytest.raises(ValueError):
        cfg(recompute="selective", checkpointing=True)
    with pytest.raises(ValueError):
        cfg(recompute="none", checkpointing=True)


# ---- schedules: micro-batches in flight ----------------------------------------------------------------------


def test_in_flight_one_f_one_b():
    d = build(cfg(pp=4), 8, **LLAMA70)
    assert [st.in_flight(d, i, 64) for i in range(4)] == [4, 3, 2, 1]
    assert [st.in_flight(d, i, 2) for i in range(4)] == [2, 2, 2, 1]  # fewer micro-batches than stages


def test_in_flight_interleaved_first_stage_is_megatrons_factor():
    """megatron/training/theoretical_memory_usage.py: the first stage holds pp micro-batches times
    (1 + (pp - 1) / (pp · vp)) when interleaved."""
    for p, v in ((4, 5), (2, 2), (8, 5), (4, 2)):
        d = build(cfg(pp=p, vp=v, grad_accum=64), p * 2, **LLAMA70)
        assert st.in_flight(d, 0, 64) == pytest.approx(p * (1 + (p - 1) / (p * v)))
        assert all(st.in_flight(d, i, 64) > st.in_flight(d, i + 1, 64) for i in range(p - 1))


def test_in_flight_gpipe_and_zero_bubble():
    d = build(cfg(pp=4, pp_schedule="gpipe"), 8, **LLAMA70)
    assert {st.in_flight(d, i, 16) for i in range(4)} == {16}
    z = build(cfg(pp=4, pp_schedule="zero-bubble"), 8, **LLAMA70)
    assert [st.in_flight(z, i, 16) for i in range(4)] == [4, 3, 2, 1]


def test_stage_assignment_with_virtual_chunks():
    d = build(cfg(pp=4, vp=5, grad_accum=8), 8, **LLAMA70)
    names = ["emb"] + [f"layer.{i}" for i in range(80)] + ["norm", "head", "loss"]
    index = {f"layer.{i}": i for i in range(80)}
    ranks = st.stages(names, index, 80, d)
    assert ranks[0].blocks[0] == "emb" and ranks[3].blocks[-3:] == ("norm", "head", "loss")
    assert ranks[0].layers == (0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51, 64, 65, 66, 67)
    assert sorted(i for r in ranks for i in r.layers) == list(range(80))
    assert {len(r.layers) for r in ranks} == {20}


def test_vocab_rows():
    assert st.vocab_rows(128256, 8) == 16032  # DTensor: ceil
    assert st.vocab_rows(128256, 8, megatron=True) == 16128  # padded to a multiple of 128 · 8 = 1024
    assert st.vocab_rows(1001, 4) == math.ceil(1001 / 4)
