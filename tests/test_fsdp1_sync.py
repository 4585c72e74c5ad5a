"""FSDP1's gradients under no_sync() accumulation, on two real gloo ranks on CPU, and the planner's rule.

Accelerate and the Hugging Face Trainer run the micro-steps before the last inside `no_sync()`: each unit keeps
its whole gradient in the compute dtype (bf16 under MixedPrecision) on the flat parameter. On the last micro-step
the post-backward hook takes that gradient off (`flat_param.grad = None`), reduce-scatters it, casts the shard
to the parameter dtype (`_cast_grad_to_param_dtype`) and the optimizer steps the fp32 shard
(torch/distributed/fsdp/_runtime_utils.py `_reduce_grad`, `_accumulate_sharded_grad`; the same steps in torch
v2.0.0's `_post_backward_hook`). World size 1 would switch FULL_SHARD to NO_SHARD, so two ranks are spawned.
"""

from __future__ import annotations

import pytest
import torch

from planner import estimate
from planner.spec import TrainConfig


def _rank(rank: int, world: int, path: str, queue) -> None:
    import weakref

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        out = {}
        for reduce in (torch.bfloat16, torch.float32):  # transformers 4.28's policy for --bf16; torchtitan's reduce
            torch.manual_seed(0)
            policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce, buffer_dtype=torch.bfloat16)
            model = FSDP(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 63)), mixed_precision=policy,
                         sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=torch.device("cpu"))
            flat = next(model.parameters())
            x = torch.randn(4, 64)
            with model.no_sync():
                model(x).float().sum().backward()
            whole = (flat.grad.dtype, flat.grad.numel())
            whole_storage = weakref.ref(flat.grad.untyped_storage())
            model(x).float().sum().backward()  # the last micro-step: reduce-scatter
            synced = (flat.grad.dtype, flat.grad.numel(), flat.numel())
            out[str(reduce)] = (whole, synced, whole_storage() is None, flat._unpadded_unsharded_size.numel())
        if rank == 0:
            queue.put(out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo unavailable")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    path = str(tmp_path_factory.mktemp("pg") / "store")
    procs = [ctx.Process(target=_rank, args=(r, 2, path, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        out = queue.get(timeout=240)
    finally:
        for p in procs:
            p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)
    return out


@pytest.mark.parametrize("reduce", ["torch.bfloat16", "torch.float32"])
def test_fsdp1_keeps_whole_bf16_gradients_under_no_sync_and_steps_fp32_shards(two_ranks, reduce):
    """Whatever the reduce dtype: bf16 whole gradients through no_sync(), fp32 shards at the step."""
    (w_dtype, w_numel), (s_dtype, s_numel, shard_numel), whole_freed, unsharded = two_ranks[reduce]
    assert (w_dtype, w_numel) == (torch.bfloat16, unsharded)  # whole, in the compute dtype
    assert whole_freed  # the whole gradient is gone once the last micro-step reduced it
    assert (s_dtype, s_numel) == (torch.float32, shard_numel)  # the optimizer steps the fp32 shard
    assert 2 * s_numel >= unsharded > 2 * (s_numel - 1)  # one of two ranks' share (padded)


def test_planner_steps_fp32_shards_after_whole_gradients_in_backward():
    """`--framework accelerate` with gradient accumulation: the backward holds every unit's whole 16-bit gradient
    (2 B x parameters); the optimizer step holds the fp32 shards (4 B x parameters / N), as with one micro-step."""
    n = 8
    base = dict(batch_size=1, seq_len=512, precision="amp-bf16", checkpointing=True, parallelism="fsdp",
                framework="accelerate")

    def phases(ga):
        est = estimate("llama-2-7b", TrainConfig(**base, grad_accum=ga), "ml.p4d.24xlarge", with_throughput=False)
        return {p.phase: p for p in est.phases}, est.parameters["total"]

    acc, total = phases(4)
    one, _ = phases(1)
    assert acc["backward"].detail["gradients"] >= 2 * total
    assert acc["optimizer"].detail["gradients"] == pytest.approx(4 * total / n, rel=1e-3)
    assert acc["optimizer"].detail["gradients"] == one["optimizer"].detail["gradients"]
