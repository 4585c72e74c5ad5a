"""`planner explain`: the estimate as a step-by-step answer, in the order users ask (seed note 000).

Pure: takes an Estimate (and re-runs `estimate` for alternatives on OOM); returns text, prints nothing.
Where the seed notes went wrong, the step says what is right and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from planner.errors import PlannerError
from planner.memory.model_states import parameter_dtype_bytes
from planner.models.blocks import model_blocks
from planner.spec import BatchNormSpec, DenseSpec, Estimate, ModelSpec, TrainConfig, TransformerSpec
from planner.units import fmt_bytes, fmt_count


@dataclass(frozen=True)
class Step:
    title: str
    lines: tuple[str, ...]


def _layer_formula(layer: DenseSpec | BatchNormSpec) -> str:
    if isinstance(layer, DenseSpec):
        b = f" + {layer.out_features}" if layer.bias else ""
        n = layer.in_features * layer.out_features + (layer.out_features if layer.bias else 0)
        return f"Linear({layer.in_features}, {layer.out_features}): {layer.in_features}×{layer.out_features}{b} = {n:,}"
    return (f"BatchNorm1d({layer.num_features}): weight + bias = 2×{layer.num_features} = {2 * layer.num_features:,}"
            f" (+ running mean/var buffers, not trained)")


def _component_lines(model: ModelSpec) -> list[str]:
    from planner.models.params import block_parameters

    blocks = model_blocks(model)
    lines = []
    for comp in model.components:
        total = sum(block_parameters(b) for b in blocks if b.component == comp.name)
        lines.append(f"{comp.name}: {total:,} parameters")
        for layer in comp.layers:
            if isinstance(layer, TransformerSpec):
                mine = [b for b in blocks if b.component == comp.name and b.layer is layer]
                by_role: dict[str, int] = {}
                for b in mine:
                    by_role[b.role] = by_role.get(b.role, 0) + block_parameters(b)
                per_layer = by_role.get("layer", 0) // layer.num_layers
                lines.append(f"  {layer.architecture} ({layer.family}: {layer.num_layers} layers, hidden "
                             f"{layer.hidden_size}, {layer.num_heads} heads, vocab {layer.vocab_size:,})")
                lines.append(f"    embeddings {by_role.get('embeddings', 0):,}; {layer.num_layers} × {per_layer:,} "
                             f"per layer = {by_role.get('layer', 0):,}" +
                             "".join(f"; {r.replace('_', ' ')} {by_role[r]:,}" for r in
                                     ("final_norm", "pooler", "head") if r in by_role))
            else:
                lines.append(f"  {_layer_formula(layer)}")
    return lines


def _precision_lines(est: Estimate) -> list[str]:
    total = est.parameters["total"]
    lines = [f"{'component':<16}{'parameters':>14}{'fp32 (4 B)':>14}{'fp16/bf16 (2 B)':>18}"]
    for name, n in est.parameters.items():
        lines.append(f"{name:<16}{n:>14,}{fmt_bytes(4 * n):>14}{fmt_bytes(2 * n):>18}")
    p = est.config.precision
    if p.startswith("amp"):
        lines.append(f"{p}: PyTorch autocast keeps fp32 parameters ({fmt_bytes(4 * total)}) and casts weights to "
                     "16 bit on the fly; those casts are cached for the forward and saved for backward "
                     "(counted with the activations). GradScaler adds only a few scalars.")
    elif p in ("fp16", "bf16"):
        lines.append(f"{p}: the model itself is cast: 2-byte parameters ({fmt_bytes(2 * total)}), gradients and "
                     "optimizer states; no fp32 master copy (pure 16-bit training).")
    else:
        lines.append(f"fp32: 4 bytes per parameter = {fmt_bytes(4 * total)} per full copy.")
    lines.append("The ZeRO paper's 16 bytes/parameter (fp16 params + fp32 master + Adam) is DeepSpeed's mixed "
                 "precision; PyTorch AMP with AdamW costs 4 (params) + 4 (grads) + 8 (Adam) = 16 bytes as well, "
                 "but all in fp32.")
    return lines


def _storage_lines(est: Estimate) -> list[str]:
    cfg, m, world = est.config, est.memory_bytes, est.world_size
    p = cfg.parallelism
    common = (f"Every GPU runs a micro-batch of {cfg.batch_size}; one optimizer step sees "
              f"{cfg.batch_size} × {cfg.grad_accum} (accumulation) × {world} GPU(s) = "
              f"{cfg.batch_size * cfg.grad_accum * world} samples.")
    if p == "single":
        return [f"One GPU holds everything: parameters {fmt_bytes(m.parameters)}, gradients "
                f"{fmt_bytes(m.gradients)}, optimizer states {fmt_bytes(m.optimizer_states)}.", common]
    if p in ("dp", "ddp"):
        kind = "nn.DataParallel" if p == "dp" else "DistributedDataParallel"
        lines = [f"{kind} keeps a FULL replica on each of the {world} GPUs: parameters {fmt_bytes(m.parameters)}, "
                 f"gradients {fmt_bytes(m.gradients)}, optimizer states {fmt_bytes(m.optimizer_states)} per GPU. "
                 "Only the batch is split. (Dividing parameter memory by the number of GPUs, as the seed note "
                 "did, is wrong: only ZeRO/FSDP sharding divides it.)", common]
        if p == "dp":
            lines.append("DataParallel also puts the whole batch and the gathered outputs on GPU 0 and runs the "
                         "optimizer there: GPU 0 is the hottest and is the one reported.")
        else:
            lines.append("DDP allocates gradient buckets as large as the gradients when it wraps the model "
                         "(unless gradient_as_bucket_view=True) and all-reduces them during backward.")
        return lines
    stage = {"zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}[p]
    sharded = ["optimizer states", "gradients", "parameters"][:stage]
    return [f"{p} shards {', '.join(sharded)} over {world} GPUs (1/{world} each); the rest is replicated. "
            f"Per GPU: parameters {fmt_bytes(m.parameters)}, gradients {fmt_bytes(m.gradients)}, optimizer states "
            f"{fmt_bytes(m.optimizer_states)}." + (" ZeRO-3/FSDP all-gathers a layer's full parameters while it "
                                                   "runs." if stage == 3 else ""), common]


def _activation_lines(model: ModelSpec, est: Estimate) -> list[str]:
    cfg, m = est.config, est.memory_bytes
    lines = ["The autograd graph's GPU cost IS the tensors it saves for backward (layer inputs, norm inputs and "
             "statistics, GELU/SiLU inputs, 1-byte dropout masks, softmax outputs, attention scores); the graph's "
             "node objects live in host memory. A '20% of activations' graph overhead has no basis.",
             f"Here one micro-batch ({cfg.batch_size} × {cfg.seq_len}, {cfg.precision}, attention {cfg.attention}"
             f", checkpointing {'on' if cfg.checkpointing else 'off'}) keeps {fmt_bytes(m.activations)}."]
    for t in model.transformers:
        b, s, h, n_layers = cfg.batch_size, cfg.seq_len, t.hidden_size, t.num_layers
        naive = b * s * h * n_layers * 4
        lines.append(f"The seed's b·s·h·L·4 = {fmt_bytes(naive)} is {m.activations / max(naive, 1):.0f}× too small: "
                     f"each layer saves many b·s·h and b·s·{t.intermediate_size // h}h tensors"
                     + (", plus b·heads·s² scores, probabilities and masks in eager attention." if cfg.attention
                        == "eager" else "; SDPA/flash kernels avoid the s² tensors."))
    if cfg.checkpointing:
        lines.append("With checkpointing each layer keeps only its input; backward recomputes one layer at a time, "
                     "so one layer's full activations come back at the backward peak (~1/3 more compute).")
    return lines


def _data_lines(model: ModelSpec, est: Estimate) -> list[str]:
    cfg = est.config
    pb = parameter_dtype_bytes(cfg.precision)
    dt = {4: "float32", 2: cfg.precision.replace("amp-", "")}[pb]
    lines = [f"Parameters and gradients: {dt} ({pb} B); optimizer states: same dtype as the parameters; "
             f"activations: {'16-bit inside autocast, fp32 for norms/softmax/loss' if cfg.precision.startswith('amp') else dt}."]
    b, s = cfg.batch_size, cfg.seq_len
    inp = model.inputs
    if model.transformers:
        for name, on in (("input_ids", inp.input_ids), ("attention_mask", inp.attention_mask),
                         ("token_type_ids", inp.token_type_ids)):
            if on:
                lines.append(f"{name}: int64 [{b}, {s}] = {fmt_bytes(8 * b * s)} (PyTorch/HF use int64, not int32)")
    if inp.tabular_features:
        lines.append(f"tabular features: float32 [{b}, {inp.tabular_features}] = "
                     f"{fmt_bytes(4 * b * inp.tabular_features)}")
    if inp.labels == "class":
        lines.append(f"labels: int64 [{b}] = {fmt_bytes(8 * b)}")
    elif inp.labels == "tokens":
        lines.append(f"labels: int64 [{b}, {s}] = {fmt_bytes(8 * b * s)}")
    lines.append(f"Input batch in all: {fmt_bytes(est.memory_bytes.batch)} per GPU.")
    return lines


def _phase_lines(est: Estimate) -> list[str]:
    m = est.memory_bytes
    lines = []
    for ph in est.phases:
        parts = ", ".join(f"{k.replace('_', ' ')} {fmt_bytes(v)}" for k, v in ph.detail.items() if v)
        lines.append(f"{ph.phase:<10} {fmt_bytes(ph.allocated):>11}  ({parts})")
    lines.append(f"Peak allocated {fmt_bytes(m.peak_allocated)} in {est.peak_phase}; the caching allocator reserves "
                 f"{fmt_bytes(m.peak_reserved)} (fragmentation {est.runtime.fragmentation:.0%}); plus CUDA context "
                 f"{fmt_bytes(m.cuda_context)} and NCCL {fmt_bytes(m.nccl)} = {fmt_bytes(m.peak_device)} on the device.")
    return lines


def _fixes(model: ModelSpec | str, est: Estimate, model_options: dict[str, Any] | None) -> list[tuple[str, Estimate]]:
    """Cheap changes that make an OOM configuration fit, fastest first."""
    from planner.estimate import estimate
    from planner.hardware import get_instance

    cfg = est.config
    inst = get_instance(est.instance)
    tries: list[tuple[str, dict[str, Any]]] = []
    k = 2
    while cfg.batch_size // k >= 1:
        tries.append((f"micro-batch {cfg.batch_size // k} with grad-accum {cfg.grad_accum * k} (same global batch)",
                      {"batch_size": cfg.batch_size // k, "grad_accum": cfg.grad_accum * k}))
        k *= 2
    if not cfg.checkpointing:
        tries.append(("activation checkpointing", {"checkpointing": True}))
    if cfg.precision == "fp32":
        amp = "amp-bf16" if inst.gpu.bf16 else "amp-fp16"
        tries.append((f"mixed precision {amp}", {"precision": amp}))
        if not cfg.checkpointing:
            tries.append((f"{amp} + checkpointing", {"precision": amp, "checkpointing": True}))
    if cfg.parallelism == "ddp" and not cfg.gradient_as_bucket_view:
        tries.append(("DDP gradient_as_bucket_view=True", {"gradient_as_bucket_view": True}))
    if est.world_size > 1:
        for z in ("zero1", "zero2", "zero3"):
            if z != cfg.parallelism:
                tries.append((f"{z} sharding", {"parallelism": z}))
    found = []
    for label, change in tries:
        try:
            alt = estimate(model, TrainConfig(**(cfg.model_dump() | change)), inst, model_options=model_options)
        except PlannerError:
            continue
        if alt.fits:
            found.append((label, alt))
    found.sort(key=lambda x: -(x[1].throughput.samples_per_s if x[1].throughput else 0))
    return found


def _largest_fitting_batch(model, est: Estimate, model_options) -> int | None:
    from planner.estimate import estimate

    cfg, lo = est.config, est.config.batch_size
    hi = lo
    while True:
        alt = estimate(model, cfg.model_copy(update={"batch_size": hi * 2}), est.instance,
                       model_options=model_options, with_throughput=False)
        if not alt.fits or hi > 4096:
            break
        hi *= 2
    lo, hi = hi, hi * 2  # lo fits, hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if estimate(model, cfg.model_copy(update={"batch_size": mid}), est.instance, model_options=model_options,
                    with_throughput=False).fits:
            lo = mid
        else:
            hi = mid
    return lo


def _verdict_lines(model: ModelSpec | str, est: Estimate, model_options) -> list[str]:
    m = est.memory_bytes
    if est.fits:
        lines = [f"FITS: {fmt_bytes(m.peak_device)} of {fmt_bytes(est.gpu_memory_bytes)} at the peak "
                 f"({est.peak_phase}); headroom {fmt_bytes(est.headroom_bytes)} "
                 f"({est.headroom_bytes / est.gpu_memory_bytes:.0%})."]
        if est.headroom_bytes < 0.05 * est.gpu_memory_bytes:
            lines.append("Headroom is under 5%: fragmentation or a longer batch can still OOM; leave a margin.")
        best = _largest_fitting_batch(model, est, model_options)
        if best:
            lines.append(f"The largest micro-batch that fits with these settings: {best}.")
        return lines
    lines = [f"OUT OF MEMORY: {fmt_bytes(m.peak_device)} needed at the {est.peak_phase} peak, "
             f"{fmt_bytes(est.gpu_memory_bytes)} on the GPU ({fmt_bytes(-est.headroom_bytes)} short)."]
    fixes = _fixes(model, est, model_options)
    if not fixes:
        lines.append("No single change tried (smaller micro-batch with accumulation, checkpointing, AMP, ZeRO) fits;"
                     " combine them or use a GPU with more memory (see `planner search --instance all`).")
    for label, alt in fixes[:5]:
        speed = f", {alt.throughput.samples_per_s:,.1f} samples/s" if alt.throughput else ""
        lines.append(f"fits with {label}: peak {fmt_bytes(alt.memory_bytes.peak_device)}, headroom "
                     f"{fmt_bytes(alt.headroom_bytes)}{speed}")
    return lines


def explain(est: Estimate, model: ModelSpec | str | None = None,
            model_options: dict[str, Any] | None = None) -> list[Step]:
    from planner.estimate import _resolve_model
    from planner.hardware import get_instance

    spec = _resolve_model(model or est.model, model_options)
    inst = get_instance(est.instance)
    g = inst.gpu
    rt = est.runtime
    return [
        Step(f"Memory of each GPU on {inst.name}", (
            f"{inst.gpus} × {g.name}, {fmt_bytes(g.memory_bytes)} nominal, {fmt_bytes(est.gpu_memory_bytes)} as the "
            "driver reports it; GPUs do not pool memory: each must hold its own share.",
            f"Not all of it is for tensors: CUDA context {fmt_bytes(rt.cuda_context_bytes)}, NCCL buffers "
            f"{fmt_bytes(est.memory_bytes.nccl)} sit outside PyTorch's allocator, so "
            f"{fmt_bytes(est.usable_memory_bytes)} is usable. Interconnect: {inst.interconnect}.",
        )),
        Step(f"How the model is stored under {est.config.parallelism}", tuple(_storage_lines(est))),
        Step("Parameters of each component", tuple(_component_lines(spec)) +
             (f"Total: {est.parameters['total']:,} ({fmt_count(est.parameters['total'])}).",)),
        Step("Their storage at each precision", tuple(_precision_lines(est))),
        Step("Gradients and optimizer states", (
            f"Gradients have the parameters' dtype: {fmt_bytes(est.memory_bytes.gradients)} per GPU; with "
            "gradient accumulation they stay allocated across micro-steps.",
            f"Optimizer states ({est.config.optimizer}): {fmt_bytes(est.memory_bytes.optimizer_states)} per GPU "
            "(AdamW: two fp32 tensors per parameter, allocated at the first step; the seed note forgot them).",
        )),
        Step('The "computational graph": saved activations', tuple(_activation_lines(spec, est))),
        Step("How parameters and data are stored", tuple(_data_lines(spec, est))),
        Step("Total by phase of one step", tuple(_phase_lines(est))),
        Step("Verdict", tuple(_verdict_lines(model or est.model, est, model_options)) + _speed_bound_lines(est)),
    ]


def _speed_bound_lines(est: Estimate) -> tuple[str, ...]:
    """What bounds the step's speed: the share of its time in kernels limited by bytes rather than FLOPs
    (planner.perf.roofline), so the user knows whether HBM bandwidth or FLOP/s buys more speed."""
    t = est.throughput
    if t is None or "bytes_bound_s" not in t.breakdown_s:
        return ()
    b = t.breakdown_s
    share = b["bytes_bound_s"] / t.step_time_s
    cpu = b.get("launch_overhead", 0.0) / t.step_time_s
    if share >= 0.5:
        head = (f"{share:.0%} of this step is memory-bound: a GPU with more HBM bandwidth helps more than one "
                "with more FLOPs.")
    else:
        head = (f"{1 - share - cpu:.0%} of this step is bound by FLOPs ({share:.0%} memory-bound): a GPU with "
                "more tensor-core FLOP/s helps most.")
    kinds = ", ".join(f"{k.replace('_', '-')} {b[k] / t.step_time_s:.0%}" for k in
                      ("gemm", "attention", "memory_bound", "optimizer", "communication", "launch_overhead")
                      if k in b)
    return (f"Speed: {head}", f"Time by kernel kind: {kinds}; MFU {t.mfu:.0%}.")
