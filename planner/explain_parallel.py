"""`explain` under tensor, context, pipeline and sharded data parallelism (issue 34): each dimension's effect on
one rank, step by step, every stage's memory and the worst rank, and the model-parallel changes the search for
"the cheapest change that fits" (planner.explain._fixes) tries."""

from __future__ import annotations

from typing import Any

from planner.parallel import get as strategy_of
from planner.spec import Estimate
from planner.units import fmt_bytes, fmt_count


def parallel_lines(est: Estimate, gpus_per_instance: int) -> list[str]:
    """Each dimension in turn, from the world down to one rank's memory."""
    p, cfg = est.parallel, est.config
    if p is None:
        return []
    lines = [f"World: {gpus_per_instance} GPUs per instance × {cfg.instances} instance(s) = {p.world} GPUs = "
             f"tensor {p.tp} × context {p.cp} × pipeline {p.pp} × data {p.dp}. Each group of "
             f"{p.tp * p.cp * p.pp} GPU(s) holds one replica of the model between them."]
    if p.tp > 1:
        where = "inside one instance (NVLink)" if p.tp <= gpus_per_instance else \
            f"across instances ({p.tp} > {gpus_per_instance} GPUs per instance: over the network)"
        lines.append(f"Tensor parallelism {p.tp}, {where}: every layer's column-parallel linears (query, key, "
                     f"value, MLP up/gate) and row-parallel linears (attention output, MLP down) are split "
                     f"{p.tp} ways, and so are the embedding table and the LM head (vocabulary-parallel); norms "
                     "stay whole on every rank. "
                     + ("In this mixture-of-experts model attention and shared experts are split so, the "
                        "routers stay whole and the routed experts are split by --ep/--etp instead (below)."
                        if "active" in est.parameters else
                        f"Parameters, gradients and optimizer states shrink by about {p.tp}×."))
        lines.append(("Sequence parallelism on: " if p.sp else "Sequence parallelism off: ")
                     + ("the norms' and dropouts' activations are split along the sequence too, so every saved "
                        "activation of a layer is divided by the TP degree (Korthikanti et al. 2022)." if p.sp else
                        "the activations outside attention and the MLP (norms, dropouts, residuals) are whole on "
                        "every TP rank."))
    if p.cp > 1:
        lines.append(f"Context parallelism {p.cp}: each rank holds {cfg.seq_len // p.cp} of the {cfg.seq_len} "
                     "tokens of a sequence (load-balanced: two chunks each); keys and values travel around the "
                     "ring in attention. Activations shrink by the degree; parameters do not.")
    if p.pp > 1:
        chunks = f" in {p.vp} virtual chunks per rank" if p.vp > 1 else ""
        counts = [len(s.layers) for s in p.stages]
        held_layers = (f"each stage holds {counts[0]} layers" if len(set(counts)) == 1 else
                       "the layers are split unevenly, as the framework splits them: the stages hold "
                       + ", ".join(str(n) for n in counts))
        lines.append(f"Pipeline parallelism {p.pp}, schedule {p.schedule}{chunks}: {held_layers}; the embedding "
                     "sits on the first stage, the final norm, the LM head and the loss on the last.")
        held = ", ".join(f"stage {s.stage}: {s.in_flight_micro_batches:g}" for s in p.stages)
        lines.append(f"{p.micro_batches} micro-batches per step; a stage keeps the activations of the micro-batches "
                     f"it has run forward but not yet backward: {held}. "
                     + _schedule_rule(p.schedule, p.vp))
    shard = strategy_of(cfg.parallelism).sharding
    replicas = f" ({p.dp_replicate} replica groups of {p.dp_shard})" if p.dp_replicate > 1 else ""
    states = [n for n, on in (("optimizer states", shard.optimizer_states or cfg.distributed_optimizer),
                              ("gradients", shard.gradients), ("parameters", shard.parameters)) if on]
    what = f"{', '.join(states)} divided over {p.dp_shard} GPUs" if states else "every state replicated"
    lines.append(f"Data parallelism {p.dp}{replicas}, {cfg.parallelism}"
                 f"{' with the distributed optimizer' if cfg.distributed_optimizer else ''}: {what}.")
    for s in p.stages:
        lines.append(f"  stage {s.stage}: {fmt_count(s.parameters)} parameters per rank; parameters "
                     f"{fmt_bytes(s.parameter_bytes)}, gradients {fmt_bytes(s.gradient_bytes)}, optimizer "
                     f"{fmt_bytes(s.optimizer_bytes)}, activations {fmt_bytes(s.activation_bytes)}; peak "
                     f"{fmt_bytes(s.peak_device_bytes)} ({s.verdict})")
    worst = p.stages[p.worst_stage]
    lines.append(f"The worst rank is stage {worst.stage}'s: its peak ({fmt_bytes(worst.peak_device_bytes)}) decides "
                 "the verdict, and every figure of one GPU below is that rank's.")
    return lines


def _schedule_rule(schedule: str, vp: int) -> str:
    if schedule == "gpipe":
        return "GPipe runs every forward before any backward: every stage holds all of them."
    if vp > 1:
        return ("Interleaved 1F1B warms up with (pp - i - 1) × 2 + (vp - 1) × pp chunk forwards on stage i "
                "(Megatron-Core schedules.py): the first stage holds pp × (1 + (pp - 1) / (pp × vp)) micro-batches.")
    return "1F1B: stage i holds min(pp - i, micro-batches) (Megatron-Core schedules.py)."


def storage_lines(est: Estimate) -> list[str]:
    """`explain`'s storage step when the model is split (est.parallel set): one rank's share, by dimension."""
    p, cfg, m = est.parallel, est.config, est.memory_bytes
    assert p is not None
    return [f"One rank (the worst: stage {p.worst_stage}) holds parameters {fmt_bytes(m.parameters)}, gradients "
            f"{fmt_bytes(m.gradients)}, optimizer states {fmt_bytes(m.optimizer_states)}: its layers' tensor-"
            f"parallel shards (1/{p.tp}), divided again over the data-parallel group as {cfg.parallelism} says.",
            f"One optimizer step sees micro-batch {cfg.batch_size} × {p.micro_batches} micro-batches × {p.dp} "
            f"data-parallel replicas = {cfg.batch_size * p.micro_batches * p.dp} samples."]


def fix_tries(est: Estimate, gpus_per_instance: int) -> list[tuple[str, dict[str, Any]]]:
    """Model-parallel changes that may make an OOM fit: more tensor parallelism (inside an instance), more
    pipeline stages, selective or full recomputation, sharded optimizer states. Each is estimated in full;
    one that breaks a layout rule is skipped."""
    p, cfg = est.parallel, est.config
    tries: list[tuple[str, dict[str, Any]]] = []
    if p is None:  # data parallelism alone: the changes planner.explain._fixes tries itself
        return tries
    tp, pp, vp = p.tp, p.pp, p.vp
    if tp * 2 <= gpus_per_instance:
        tries.append((f"tensor parallelism --tp {tp * 2}", {"tp": tp * 2}))
    from planner.parallel.layer_split import SPLIT_FIELDS
    from planner.spec import TrainConfig

    even = {f: TrainConfig.model_fields[f].default for f in SPLIT_FIELDS}  # a doubled pipeline: the framework's split
    tries.append((f"pipeline parallelism --pp {pp * 2}", {"pp": pp * 2, **even}))
    if vp > 1:
        tries.append((f"--pp {pp * 2} --vp {max(vp // 2, 1)}", {"pp": pp * 2, "vp": max(vp // 2, 1),
                                                                 "pp_schedule": None, **even}))
    if cfg.recompute_mode == "none":
        tries.append(("selective recomputation of attention (--recompute selective --recompute-modules "
                      "core_attn)", {"recompute": "selective", "recompute_modules": ("core_attn",)}))
    if cfg.recompute_mode != "full":
        tries.append(("full recomputation (--recompute full)", {"recompute": None, "recompute_modules": (),
                                                                "checkpointing": True}))
    if not strategy_of(cfg.parallelism).sharding.optimizer_states and not cfg.distributed_optimizer:
        tries.append(("the distributed optimizer (--distributed-optimizer)", {"distributed_optimizer": True}))
    return tries
