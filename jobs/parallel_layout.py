"""Run a model-parallel layout for real: a DeviceMesh, DTensor tensor (and sequence) parallelism, FSDP2 over the
data-parallel dimensions and `torch.distributed.pipelining` stages, on a Llama-style transformers model.

The probe job (`probe.py`) imports this when a request asks for tensor, pipeline or context parallelism (or
HSDP). It runs on the training machine, so it needs only torch and transformers: on GPUs with NCCL under
`torchrun` (one process per GPU, several SageMaker instances), and on a CPU with the gloo backend, where the
tests run 2-4 processes on a tiny model.

How each piece follows its source:

* The mesh: torchtitan's `ParallelDims` (torchtitan/distributed/parallel_dims.py @0119de15,
  `_build_mesh_without_ep`): `init_device_mesh(device, (pp, dp_replicate, dp_shard, cp, tp),
  mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"))`, the product equal to the world size. DDP
  lives on `dp_replicate`, FSDP on `dp_shard`, HSDP on both (torchtitan's naming). Unlike torchtitan, size-1
  dimensions are kept so every rank can report its coordinate in each.
* Tensor + sequence parallelism: torchtitan's `apply_tp` (torchtitan/models/llama3/infra/parallelize.py
  @018740b7), mapped onto the transformers Llama module names: the embedding `RowwiseParallel` (vocabulary
  parallel) with a sequence-sharded output, norms `SequenceParallel`, `PrepareModuleInput` all-gathering the
  sequence before attention and MLP, q/k/v/gate/up `ColwiseParallel`, o/down `RowwiseParallel` reduce-
  scattering back to the sequence shard, the LM head `ColwiseParallel`. Without SP (`--no-sp`) activations
  stay replicated between blocks (Megatron's TP without SP). transformers' Llama attention reshapes with
  `view(*shape, -1, head_dim)`, so each rank's attention runs on its heads/TP heads without editing
  `num_heads` (torchtitan edits `n_heads` of its own model for the same reason).
* The loss under TP: `loss_parallel()` on vocabulary-sharded logits (torchtitan's default, Megatron's
  vocab-parallel cross entropy), so no rank materialises the full logits.
* FSDP2: torchtitan's `apply_fsdp`: `fully_shard` each decoder layer, the embedding, the norm with the LM
  head, then the root, on the `dp_shard` mesh (HSDP: the 2-D `dp_replicate` × `dp_shard` mesh);
  `reshard_after_forward` off under PP (torchtitan's default) and for ZeRO-2.
* Pipeline: torchtitan's pipeline split (torchtitan/distributed/pipeline_parallel.py): `pp × vp` stages of
  consecutive decoder layers, the embedding on the first, norm + LM head + loss on the last; rank r of the
  `pp` dimension holds stages r, r + pp, ... (the "loop" style `ScheduleInterleaved1F1B` expects); each stage
  a `PipelineStage`, run by `ScheduleGPipe`, `Schedule1F1B`, `ScheduleInterleaved1F1B` or
  `ScheduleInterleavedZeroBubble` as `--pp-schedule` says, `n_microbatches` micro-batches per step.
* DDP with TP or PP: gradients all-reduced over the data-parallel group after backward (what DDP does,
  without its buckets; torchtitan refuses DDP with more than one dimension).
* Context parallelism is refused: `torch.distributed.tensor.experimental.context_parallel` rewrites SDPA into
  ring attention only for the CUDA kernels (torch 2.13,
  torch/distributed/tensor/experimental/_context_parallel/_attention.py: handlers for
  aten._scaled_dot_product_{flash,efficient,cudnn}_attention and their backwards; CPU SDPA dispatches to
  _scaled_dot_product_flash_attention_for_cpu or the math kernel, which it leaves alone), so a CPU test
  cannot run it, and the probe runs nothing its tests cannot.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
             "zero-bubble": "ScheduleInterleavedZeroBubble"}
SHARDED = ("zero2", "zero3", "fsdp", "hsdp")  # data parallelism run by fully_shard


class LayoutError(Exception):
    """The request's layout cannot run here; probe.py reports it as `unsupported`."""


@dataclass(frozen=True)
class Layout:
    """The degrees of one job, as `planner/parallel/dims.py` checked them (the job cannot import the planner,
    so the request carries the resolved config and this re-derives the same record)."""

    parallelism: str
    tp: int = 1
    cp: int = 1
    pp: int = 1
    vp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    sp: bool = False
    schedule: str = "none"
    # decoder layers in each of the pp × vp stages, in stage order, as the planner's layout record split them
    # (planner/parallel/layer_split.py: Megatron's --first/--last-stage-layers, --account-for-*, --pp-layout;
    # torchtitan's and NeMo AutoModel's leftover layers); () = an even split
    chunks: tuple[int, ...] = ()
    # FSDP's reshard after forward as the job sets it (--reshard-after-forward); None: torchtitan's "default"
    # policy (off under PP, on otherwise; off for ZeRO-2)
    reshard_after_forward: bool | None = None

    @property
    def reshard(self) -> bool:
        if self.reshard_after_forward is not None:
            return self.reshard_after_forward
        return self.parallelism != "zero2" and self.pp == 1

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def degrees(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def requested(config: dict[str, Any]) -> bool:
    """Whether the request asks for more than data parallelism (the probe's older path runs that)."""
    return any(int(config.get(k) or 1) > 1 for k in ("tp", "cp", "pp")) or config.get("parallelism") == "hsdp"


def layout_of(config: dict[str, Any], world: int, chunks: Any = ()) -> Layout:
    """The layout of a request's config over `world` processes; a LayoutError names the rule it breaks
    (the same rules as planner/parallel/dims.build, which already refused bad input before the job).
    `chunks`: the request's `stage_layers`, the planner's uneven split (empty: an even one)."""
    tp, cp, pp, vp = (int(config.get(k) or 1) for k in ("tp", "cp", "pp", "vp"))
    parallelism = config.get("parallelism") or "ddp"
    if parallelism == "auto":  # as probe.make_plan resolves it for several processes
        parallelism = "ddp"
    if world % (tp * cp * pp):
        raise LayoutError(f"tp × cp × pp = {tp * cp * pp} does not divide the {world} processes")
    dp = world // (tp * cp * pp)
    replicas = int(config.get("dp_replicas") or 1)
    if dp % replicas:
        raise LayoutError(f"dp_replicas={replicas} does not divide the data-parallel size {dp}")
    if parallelism == "hsdp":
        dp_replicate, dp_shard = replicas, dp // replicas
    elif parallelism in SHARDED:
        dp_replicate, dp_shard = 1, dp
    elif parallelism in ("ddp", "single"):
        dp_replicate, dp_shard = dp, 1
    else:
        raise LayoutError(f"parallelism={parallelism} with tp/pp/cp: the probe runs ddp, zero2, zero3, fsdp or "
                          "hsdp over a DeviceMesh (ZeRO-1 and DataParallel have no DeviceMesh form)")
    sp = config.get("sp")
    sp = tp > 1 if sp is None else bool(sp) and tp > 1
    schedule = "none"
    if pp > 1:
        schedule = config.get("pp_schedule") or ("interleaved-1f1b" if vp > 1 else "1f1b")
    if config.get("distributed_optimizer"):
        raise LayoutError("distributed_optimizer (Megatron's) needs Megatron-Core, which the probe does not run")
    if cp > 1:
        raise LayoutError(f"cp={cp}: context parallelism (torch context_parallel) needs CUDA SDPA kernels; the "
                          "probe does not run it")
    chunks = tuple(int(c) for c in (chunks or ()))
    if chunks and (len(chunks) != pp * vp or min(chunks) < 0):
        raise LayoutError(f"stage_layers {list(chunks)}: one count of 0 or more layers per stage, pp × vp = "
                          f"{pp * vp} of them")
    return Layout(parallelism=parallelism, tp=tp, cp=cp, pp=pp, vp=vp, dp_replicate=dp_replicate,
                  dp_shard=dp_shard, sp=sp, schedule=schedule, chunks=chunks,
                  reshard_after_forward=(None if config.get("reshard_after_forward") is None
                                         else bool(config["reshard_after_forward"])))


def build_mesh(layout: Layout, device_type: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, layout.degrees, mesh_dim_names=DIMS)


def coordinates(mesh: Any) -> dict[str, int]:
    """This rank's index along each mesh dimension."""
    return {name: int(mesh[name].get_local_rank()) for name in DIMS}


# ----------------------------------------------------------------------------------------- the model


def llama_parts(model: Any) -> tuple[Any, Any]:
    """(decoder base model, LM head) of a transformers *ForCausalLM with Llama's module names, or a
    LayoutError saying what the probe's model-parallel path supports."""
    inner = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    names = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or head is None or not all(hasattr(inner, n) for n in names):
        raise LayoutError(f"{type(model).__name__}: the probe's TP/PP path runs Llama-style causal LMs "
                          "(model.embed_tokens, model.layers, model.norm, lm_head)")
    layer = inner.layers[0]
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) or not all(
            hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        raise LayoutError(f"{type(layer).__name__}: TP needs q/k/v/o_proj attention and a gate/up/down MLP")
    if head.weight is inner.embed_tokens.weight:
        raise LayoutError("tied input and output embeddings: the probe's TP/PP path needs them untied "
                          "(tie_word_embeddings false, as in Llama 2/3 8B and larger)")
    return inner, head


def stage_layers(n_layers: int, layout: Layout) -> list[list[int]]:
    """Decoder layer indices of each of the pp × vp stages, consecutive: as many as `layout.chunks` says (the
    planner's uneven split), else equal (dims.build checked that pp × vp divides the layers)."""
    stages = layout.pp * layout.vp
    if layout.chunks:
        if sum(layout.chunks) != n_layers:
            raise LayoutError(f"stage_layers {list(layout.chunks)} hold {sum(layout.chunks)} layers; the model "
                              f"has {n_layers}")
        starts = [sum(layout.chunks[:s]) for s in range(stages)]
        return [list(range(a, a + n)) for a, n in zip(starts, layout.chunks, strict=True)]
    if n_layers % stages:
        raise LayoutError(f"pp × vp = {stages} stages do not divide the model's {n_layers} layers")
    per = n_layers // stages
    return [list(range(s * per, (s + 1) * per)) for s in range(stages)]


def local_stage_ids(layout: Layout, pp_rank: int) -> list[int]:
    """Stages this pipeline rank holds: pp_rank, pp_rank + pp, ... ("loop" style)."""
    return [pp_rank + v * layout.pp for v in range(layout.vp)]


def _stage_class() -> Any:
    import torch
    from torch import nn

    class LlamaStage(nn.Module):
        """One pipeline stage of a Llama-style model: the embedding on the first, some decoder layers, the
        final norm and LM head on the last. Returns logits (last) or hidden states. Under TP with SP, hidden
        states between stages travel as this rank's sequence shard (a plain tensor, as pipelining sends)."""

        def __init__(self, inner: Any, head: Any, layer_ids: list[int], first: bool, last: bool,
                     attention: str) -> None:
            super().__init__()
            self.embed_tokens = inner.embed_tokens if first else None
            # keys are the model's layer indices, as torchtitan's ModuleDict (checkpoint names stay)
            self.layers = nn.ModuleDict({str(i): inner.layers[i] for i in layer_ids})
            self.norm = inner.norm if last else None
            self.lm_head = head if last else None
            self.rotary_emb = inner.rotary_emb
            self.attention = attention
            self.sequence_mesh: Any = None  # the tp mesh when SP shards the sequence between blocks

        def forward(self, x: Any) -> Any:
            from torch.distributed.tensor import DTensor, Shard

            if self.embed_tokens is not None:
                h = self.embed_tokens(x)
            elif self.sequence_mesh is not None:  # this rank's sequence shard from the previous stage
                h = DTensor.from_local(x, self.sequence_mesh, [Shard(1)], run_check=False)
            else:
                h = x
            seq = h.shape[1]  # the global length, also for a sequence-sharded DTensor
            positions = torch.arange(seq, device=x.device).unsqueeze(0)
            probe = h.to_local() if isinstance(h, DTensor) else h
            cos, sin = self.rotary_emb(probe, positions)
            mask = None  # sdpa / flash: causal through is_causal when no mask is given (transformers)
            if self.attention == "eager":
                mask = torch.full((seq, seq), float("-inf"), device=x.device, dtype=cos.dtype).triu(1)[None, None]
            for layer in self.layers.values():
                h = layer(h, attention_mask=mask, position_embeddings=(cos, sin), position_ids=positions)
            if self.norm is not None:
                h = self.norm(h)
            if self.lm_head is not None:
                return self.lm_head(h)
            return h.to_local() if isinstance(h, DTensor) else h

    return LlamaStage


def causal_lm_loss(logits: Any, labels: Any) -> Any:
    """Next-token cross entropy averaged over tokens, as transformers' ForCausalLMLoss computes it (fp32
    logits; the last position has no target). Vocabulary-sharded DTensor logits work inside loss_parallel()."""
    import torch

    logits = logits[:, :-1, :].float()
    target = labels[:, 1:]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(0, 1))


def apply_tp(stage: Any, tp_mesh: Any, sp: bool) -> None:
    """torchtitan's apply_tp on transformers' Llama names (see the module docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    between = Shard(1) if sp else Replicate()  # the hidden states' layout between blocks
    top: dict[str, Any] = {}
    if stage.embed_tokens is not None:
        top["embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between,
                                              use_local_output=not sp)
    if stage.norm is not None:
        top["norm"] = SequenceParallel() if sp else None
        # vocabulary-sharded logits for loss_parallel()
        top["lm_head"] = ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False)
    top = {k: v for k, v in top.items() if v is not None}
    if top:
        parallelize_module(stage, tp_mesh, top)
    for layer in stage.layers.values():
        # Without SP the blocks exchange plain replicated tensors (all-reduce after o_proj and down_proj);
        # with SP, sequence-sharded DTensors (reduce-scatter there, all-gather before attention and MLP).
        plan: dict[str, Any] = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=between, use_local_output=not sp),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=between, use_local_output=not sp),
        }
        if sp:
            plan.update({
                "input_layernorm": SequenceParallel(),
                "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": between},
                                                desired_input_kwarg_layouts={"hidden_states": Replicate()}),
                "post_attention_layernorm": SequenceParallel(),
                "mlp": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(layer, tp_mesh, plan)
    if sp:
        stage.sequence_mesh = tp_mesh


def apply_fsdp(stage: Any, dp_mesh: Any, *, reshard: bool) -> None:
    """torchtitan's apply_fsdp: each decoder layer, the embedding, the norm with the LM head, the stage."""
    from torch.distributed.fsdp import fully_shard

    if stage.embed_tokens is not None:
        fully_shard(stage.embed_tokens, mesh=dp_mesh, reshard_after_forward=reshard)
    for layer in stage.layers.values():
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard)
    if stage.lm_head is not None:
        fully_shard([stage.norm, stage.lm_head], mesh=dp_mesh, reshard_after_forward=False)
    fully_shard(stage, mesh=dp_mesh, reshard_after_forward=reshard)


@dataclass
class Parallel:
    """What one rank runs: its stages (modules), the pipeline schedule (None without PP), the mesh."""

    layout: Layout
    mesh: Any
    stages: list[Any]
    schedule: Any
    n_microbatches: int
    dp_group: Any  # the process group DDP all-reduces over (None unless ddp with dp > 1)
    info: dict[str, Any]

    def parameters(self) -> list[Any]:
        return [p for s in self.stages for p in s.parameters()]

    @property
    def coords(self) -> dict[str, int]:
        return coordinates(self.mesh)


def parallelize(model: Any, layout: Layout, device: Any, *, attention: str, n_microbatches: int) -> Parallel:
    """Split, shard and wrap `model` (built whole on `device`, identical on every rank) as `layout` says.
    Activation checkpointing, when asked, is already on the decoder layers (transformers'
    GradientCheckpointingLayer, set by probe.build), and stays on inside the stages."""
    import torch

    if torch.distributed.get_world_size() != layout.world:
        raise LayoutError(f"the layout needs {layout.world} processes, found {torch.distributed.get_world_size()}")
    inner, head = llama_parts(model)
    mesh = build_mesh(layout, device.type)
    coords = coordinates(mesh)
    groups = stage_layers(len(inner.layers), layout)
    ids = local_stage_ids(layout, coords["pp"]) if layout.pp > 1 else [0]
    n_stages = layout.pp * layout.vp
    stage_cls = _stage_class()
    stages = [stage_cls(inner, head, groups[s], first=s == 0, last=s == len(groups) - 1, attention=attention)
              for s in ids]  # without PP: one stage holding every layer (groups has one entry)
    if layout.tp > 1:
        for stage in stages:
            apply_tp(stage, mesh["tp"], layout.sp)
    dp_group = None
    if layout.parallelism in SHARDED and layout.dp > 1:
        dp_mesh = mesh["dp_replicate", "dp_shard"] if layout.parallelism == "hsdp" else mesh["dp_shard"]
        for stage in stages:
            apply_fsdp(stage, dp_mesh, reshard=layout.reshard)
    elif layout.dp > 1:
        dp_group = mesh["dp_replicate"].get_group()
    schedule = None
    if layout.pp > 1:
        schedule = make_schedule(stages, ids, n_stages, layout, mesh, device, n_microbatches)
    info = {"mesh": dict(zip(DIMS, layout.degrees, strict=True)), "coordinates": coords,
            "stages": ids, "stage_layers": [groups[s] for s in ids], "schedule": type(schedule).__name__ if schedule else None,
            "n_microbatches": n_microbatches, "sp": layout.sp,
            "data_parallel": ("fully_shard" if layout.parallelism in SHARDED and layout.dp > 1
                              else "all-reduce" if dp_group is not None else None),
            "loss": "loss_parallel (vocabulary-sharded logits)" if layout.tp > 1 else "cross_entropy"}
    return Parallel(layout, mesh, stages, schedule, n_microbatches, dp_group, info)


def materialize(parallel: Parallel, device: Any, *, std: float, seed: int) -> None:
    """Give a layout built on the meta device its memory and weights, as torchtitan does (`to_empty`, then
    `init_weights`), so no rank ever holds more than its own shards. Weights follow transformers' Llama
    initialisation (`PreTrainedModel._init_weights`: linear and embedding weights normal(0, initializer_range),
    biases zero, RMSNorm weights one); the rotary frequencies are computed afresh. Each rank draws its local
    shards from its own generator, seeded by its place in the mesh without `dp_replicate`, so DDP/HSDP replicas
    start equal (no DTensor RNG tracker needed). The weights differ from a whole-model build of the same seed:
    what this path measures is memory and speed, and the loss only has to be finite."""
    import torch

    c, lay = parallel.coords, parallel.layout
    place = ((c["pp"] * lay.dp_shard + c["dp_shard"]) * lay.cp + c["cp"]) * lay.tp + c["tp"]
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1_000_003 + place)
    for stage in parallel.stages:
        stage.to_empty(device=device)
        with torch.no_grad():
            for module in stage.modules():
                kind = type(module).__name__
                for name, p in module.named_parameters(recurse=False):
                    local = p.to_local() if hasattr(p, "to_local") else p
                    if "Norm" in kind or name == "bias":
                        local.fill_(1.0 if "Norm" in kind and name == "weight" else 0.0)
                    else:
                        local.normal_(0.0, std, generator=gen)
        rotary = stage.rotary_emb
        with torch.device(device):
            stage.rotary_emb = type(rotary)(rotary.config)


def make_schedule(stages: list[Any], ids: list[int], n_stages: int, layout: Layout, mesh: Any, device: Any,
                  n_microbatches: int) -> Any:
    import torch.distributed.pipelining as pipelining

    name = SCHEDULES.get(layout.schedule)
    if name is None:
        raise LayoutError(f"pp_schedule={layout.schedule}: one of {', '.join(SCHEDULES)}")
    group = mesh["pp"].get_group()
    pipe_stages = [pipelining.PipelineStage(stage, sid, n_stages, device, group=group)
                   for stage, sid in zip(stages, ids, strict=True)]
    cls = getattr(pipelining, name)
    loss = _pipeline_loss(layout.tp > 1)
    if layout.vp > 1 or name == "ScheduleInterleavedZeroBubble":
        return cls(pipe_stages, n_microbatches=n_microbatches, loss_fn=loss)
    return cls(pipe_stages[0], n_microbatches=n_microbatches, loss_fn=loss)


def _pipeline_loss(vocab_parallel: bool) -> Any:
    def loss_fn(logits: Any, labels: Any) -> Any:
        # runs inside pipeline_step's loss_context (a nested loss_parallel() would switch it off on exit)
        loss = causal_lm_loss(logits, labels)
        # the schedule back-propagates from a plain tensor (to_local is differentiable; the loss is replicated)
        return loss.to_local() if vocab_parallel and hasattr(loss, "to_local") else loss

    return loss_fn


def loss_context(vocab_parallel: bool) -> Any:
    import contextlib

    if not vocab_parallel:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def local_parameter_count(parallel: Parallel) -> int:
    """Elements of the parameters this rank holds (DTensor shards: the local shard)."""
    return sum(int((p.to_local() if hasattr(p, "to_local") else p).numel()) for p in parallel.parameters())


def forward_loss(parallel: Parallel, batch: dict[str, Any]) -> Any:
    """The one stage's loss (no pipeline); call `backward` on it inside the same loss_context."""
    return causal_lm_loss(parallel.stages[0](batch["input_ids"]), batch["labels"])


def pipeline_step(parallel: Parallel, batch: dict[str, Any]) -> float | None:
    """Forward and backward of all micro-batches by the schedule (loss on the last stage). Returns their mean
    loss on the rank holding the last stage, None on the others."""
    import torch

    coords = parallel.coords
    # stage 0 on pp rank 0, the last stage on pp rank pp - 1 (also interleaved: the "loop" style)
    first, last = coords["pp"] == 0, coords["pp"] == parallel.layout.pp - 1
    losses: list[Any] = []
    kwargs = {"target": batch["labels"], "losses": losses} if last else {}
    with loss_context(parallel.layout.tp > 1):
        if first:
            parallel.schedule.step(batch["input_ids"], **kwargs)
        else:
            parallel.schedule.step(**kwargs)
    if last and losses:
        return float(torch.stack([scalar(x) for x in losses]).mean().item())
    return None


def scalar(loss: Any) -> Any:
    """A loss as a plain fp32 tensor (a DTensor loss under loss_parallel is replicated)."""
    loss = loss.detach()
    if hasattr(loss, "full_tensor"):
        loss = loss.full_tensor()
    return loss.float()


def all_reduce_gradients(parallel: Parallel) -> None:
    """DDP's gradient average over the data-parallel group (ddp with TP/PP)."""
    import torch.distributed as dist

    if parallel.dp_group is None:
        return
    size = dist.get_world_size(parallel.dp_group)
    for p in parallel.parameters():
        if p.grad is not None:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            dist.all_reduce(g, group=parallel.dp_group)
            g.div_(size)


def microbatches(config: dict[str, Any], layout: Layout, batch_size: int) -> int:
    """Micro-batches per step: global batch / (micro-batch × dp) when the config gives a global batch
    (Megatron's num_microbatches), else grad_accum."""
    total = config.get("global_batch_size")
    if total:
        n, rest = divmod(int(total), batch_size * layout.dp)
        if rest or n < 1:
            raise LayoutError(f"global_batch_size={total} is not a multiple of batch × dp = {batch_size * layout.dp}")
        return n
    return max(1, int(config.get("grad_accum") or 1))

