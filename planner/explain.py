"""`planner explain`: the estimate as a step-by-step answer, in the order users ask.

Pure: takes an Estimate (and re-runs `estimate` for alternatives on OOM, and for nn.DataParallel beside the
DDP that `auto` picks); returns text, prints nothing. Where a common rule of thumb is wrong, the step says
what the rule is, what is right, and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from planner.errors import PlannerError
from planner.explain_where import batch_where, where_states_live  # noqa: F401  (re-exported)
from planner.memory.model_states import parameter_dtype_bytes
from planner.models.blocks import model_blocks
from planner.parallel import AUTO_MULTI_GPU
from planner.parallel import get as strategy_of
from planner.program.sources import many_batches
from planner.spec import (
    BatchNormSpec,
    DenseSpec,
    Estimate,
    ModelSpec,
    TrainConfig,
    TransformerSpec,
)
from planner.units import fmt_bytes, fmt_count


@dataclass(frozen=True)
class Step:
    title: str
    lines: tuple[str, ...]
    # The numbers the lines state, as fields (bytes, counts, samples/s), for `explain --json` readers who
    # should not parse prose; keys follow `estimate --json`.
    figures: dict[str, Any] = field(default_factory=dict)


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
        if name in ("trainable", "frozen", "active"):  # an adapter run's split, MoE's active: said elsewhere
            continue
        lines.append(f"{name:<16}{n:>14,}{fmt_bytes(4 * n):>14}{fmt_bytes(2 * n):>18}")
    p = est.config.precision
    from planner.memory.framework_layout import layout

    if p.startswith("amp") and layout(est.config).kind != "autocast":
        pass  # a mixed-precision policy or a 16-bit engine: the framework's lines below say how it stores them
    elif p.startswith("amp"):
        lines.append(f"{p}: PyTorch autocast keeps fp32 parameters ({fmt_bytes(4 * total)}) and casts weights to "
                     "16 bit on the fly; those casts are cached for the forward and saved for backward "
                     "(counted with the activations). GradScaler adds only a few scalars.")
    elif p in ("fp16", "bf16"):
        lines.append(f"{p}: the model itself is cast: 2-byte parameters ({fmt_bytes(2 * total)}), gradients and "
                     "optimizer states; no fp32 master copy (pure 16-bit training).")
    else:
        lines.append(f"fp32: 4 bytes per parameter = {fmt_bytes(4 * total)} per full copy.")
    if est.config.tf32:
        has = "tf32" in _gpu_peaks(est.gpu)
        lines.append("TF32 on (--tf32): fp32 matmuls run on tensor cores with 10-bit mantissas; memory is "
                     "unchanged, only speed. " + ("This GPU has TF32 tensor cores." if has else
                                                 "This GPU has no TF32 tensor cores (before Ampere): no effect."))
    lines.append("The ZeRO paper's 16 bytes/parameter (fp16 params + fp32 master + Adam) is DeepSpeed's mixed "
                 "precision; PyTorch AMP with AdamW costs 4 (params) + 4 (grads) + 8 (Adam) = 16 bytes as well, "
                 "but all in fp32.")
    return lines + _framework_lines(est)


def _framework_lines(est: Estimate) -> list[str]:
    """What --framework changes here: its layout, and under FSDP with AMP why autocast and a mixed-precision
    policy differ (the autocast weight cache against the 16-bit units)."""
    from planner.memory.framework_layout import describe, layout
    from planner.parallel.frameworks import get as framework

    cfg = est.config
    fw, lay = framework(cfg.framework), layout(cfg)
    lines = [f"Framework: {fw.label} runs {cfg.parallelism} as {fw.runs(cfg.parallelism)}."]
    if describe(lay):
        lines.append(describe(lay) + ".")
    total = est.parameters["total"]
    if strategy_of(cfg.parallelism).fsdp and cfg.precision.startswith("amp"):
        if lay.autocast_cache:
            lines.append(f"Why this differs from an FSDP mixed-precision policy (--framework torchtitan or "
                         f"accelerate): autocast's cache keeps the 16-bit cast of each unsharded parameter until the "
                         f"forward ends, {fmt_bytes(2 * total)} for the whole model at its end, on every GPU "
                         "whatever the sharding; a policy all-gathers each unit in 16 bits and frees it after the "
                         "unit's forward, so only the units computing or prefetched are held.")
        elif lay.kind == "policy":
            lines.append(f"Why this differs from --framework pytorch (torch.autocast around FSDP2): there the "
                         f"unsharded fp32 parameters are leaves, so autocast caches each one's 16-bit cast until the "
                         f"forward ends, {fmt_bytes(2 * total)} at its end; here no autocast runs and no full "
                         "16-bit copy exists.")
    return lines


def _known_gpu(gpu_name: str):
    """The GPU's datasheet row, or None for a name the table does not hold."""
    from planner.hardware import get_gpu

    try:
        return get_gpu(gpu_name)
    except (PlannerError, KeyError):
        return None


def _gpu_peaks(gpu_name: str) -> dict[str, float]:
    gpu = _known_gpu(gpu_name)
    return gpu.peak_tflops if gpu is not None else {}


def _storage_lines(est: Estimate) -> list[str]:
    if est.parallel is not None:  # the model split over tensor/context/pipeline groups: one rank's share
        from planner.explain_parallel import storage_lines

        lines = storage_lines(est)
    else:
        lines = _storage_lines_of_strategy(est)
    if "active" in est.parameters:  # a mixture-of-experts model (issue 35; docs/moe.md)
        cfg = est.config
        ep = cfg.ep * cfg.etp
        base = est.parameters.get("frozen", est.parameters["total"])  # under LoRA: the base model's, no adapters
        lines.append(f"Mixture of experts: {est.parameters['active']:,} of {base:,} parameters "
                     "are active per token (the FLOPs count those). "
                     + (f"--ep {cfg.ep}{f' × --etp {cfg.etp}' if cfg.etp > 1 else ''}: each GPU holds 1/{ep} of "
                        f"every MoE layer's experts (and their gradients and optimizer states), sharded further "
                        f"over the {est.world_size // (ep * cfg.pp)} GPU(s) of the expert data-parallel group "
                        "when the strategy shards; attention, norms, embeddings and routers as above"
                        + (f" (attention and shared experts split over --tp {cfg.tp}, the routed experts not; "
                           "each GPU routes its own share of the sequence)" if cfg.tp > 1 else "")
                        + ". Each MoE layer "
                        "sends its tokens to their experts' GPUs and back (all-to-all) in forward and backward"
                        + (f"; the busiest GPU gets {cfg.moe_imbalance:g}× the mean share of tokens and decides "
                           "the verdict." if cfg.moe_imbalance != 1.0 else ".") if ep > 1 else
                        "Every GPU holds all experts (--ep 1)."))
    return lines


def _storage_lines_of_strategy(est: Estimate) -> list[str]:
    cfg, m, world = est.config, est.memory_bytes, est.world_size
    p = cfg.parallelism
    strategy = strategy_of(p)
    common = (f"Every GPU runs a micro-batch of {cfg.batch_size}; one optimizer step sees "
              f"{cfg.batch_size} × {cfg.grad_accum} (accumulation) × {world} GPU(s) = "
              f"{cfg.batch_size * cfg.grad_accum * world} samples.")
    if strategy.uses_one_gpu:
        return [f"One GPU holds everything: parameters {fmt_bytes(m.parameters)}, gradients "
                f"{fmt_bytes(m.gradients)}, optimizer states {fmt_bytes(m.optimizer_states)}.", common]
    if strategy.one_process:
        return _dataparallel_lines(est)
    stage = strategy.sharding.zero_stage
    if not stage:
        return [f"DistributedDataParallel runs one process per GPU, each with a FULL replica: parameters "
                f"{fmt_bytes(m.parameters)}, gradients {fmt_bytes(m.gradients)}, optimizer states "
                f"{fmt_bytes(m.optimizer_states)} on every one of the {world} GPUs. Only the batch is split. "
                "(A common shortcut divides parameter memory by the number of GPUs; that holds only for "
                "ZeRO/FSDP sharding.)", common,
                "DDP allocates gradient buckets as large as the gradients when it wraps the model "
                "(unless gradient_as_bucket_view=True) and all-reduces them during backward."]
    sharded = ["optimizer states", "gradients", "parameters"][:stage]
    return [f"{p} shards {', '.join(sharded)} over {world} GPUs (1/{world} each); the rest is replicated. "
            f"Per GPU: parameters {fmt_bytes(m.parameters)}, gradients {fmt_bytes(m.gradients)}, optimizer states "
            f"{fmt_bytes(m.optimizer_states)}." + (" ZeRO-3/FSDP all-gathers a layer's full parameters while it "
                                                   "runs." if stage == 3 else ""), common]


def _dataparallel_lines(est: Estimate) -> list[str]:
    """nn.DataParallel (torch/nn/parallel/data_parallel.py): one process; the module, its gradients and the
    optimizer live on GPU 0; each forward broadcasts the parameters to the other GPUs (replicate), scatters
    the batch, gathers the outputs on GPU 0; backward reduces the gradients onto GPU 0's parameters."""
    cfg, m, world = est.config, est.memory_bytes, est.world_size
    return [f"nn.DataParallel is one process. The figures are GPU 0's, the fullest: it holds the model "
            f"(parameters {fmt_bytes(m.parameters)}), ALL the gradients ({fmt_bytes(m.gradients)}, reduced onto "
            f"it in backward) and ALL the optimizer states ({fmt_bytes(m.optimizer_states)}; the optimizer "
            f"steps there).",
            f"The other {world - 1} GPUs hold, during forward and backward only, a broadcast copy of the "
            "parameters and their own activations; no gradients or optimizer states stay on them.",
            f"The batch: you pass {cfg.batch_size * world} samples; DataParallel scatters {cfg.batch_size} to "
            f"each GPU (the 'input batch' row is that share). The rest of the batch, before the scatter, and "
            "the outputs gathered back from every GPU also sit on GPU 0: they are counted in 'temporaries "
            "and buffers'.",
            f"One optimizer step sees {cfg.batch_size} × {cfg.grad_accum} (accumulation) × {world} GPUs = "
            f"{cfg.batch_size * cfg.grad_accum * world} samples. (A common shortcut divides parameter memory by "
            "the number of GPUs; no GPU here holds less than a full copy.)"]


def _activation_lines(model: ModelSpec, est: Estimate) -> list[str]:
    cfg, m = est.config, est.memory_bytes
    lines = ["The autograd graph's GPU cost IS the tensors it saves for backward (layer inputs, norm inputs and "
             "statistics, GELU/SiLU inputs, 1-byte dropout masks, softmax outputs, attention scores); the graph's "
             "node objects live in host memory. A '20% of activations' graph overhead has no basis.",
             f"Here one micro-batch ({cfg.batch_size} × {cfg.seq_len}, {cfg.precision}, attention {cfg.attention}"
             f", checkpointing {'on' if cfg.checkpointing else 'off'}) keeps {fmt_bytes(m.activations)}."]
    if est.parallel is not None:  # the worst stage's layers, its shards, every micro-batch it holds in flight
        worst = est.parallel.stages[est.parallel.worst_stage]
        lines[-1] = (f"Here the worst rank (stage {worst.stage}: {len(worst.layers)} layers, its tensor/context-"
                     f"parallel shard) keeps {fmt_bytes(m.activations)} for {worst.in_flight_micro_batches:g} "
                     f"micro-batches in flight ({cfg.batch_size} × {cfg.seq_len}, {cfg.precision}, attention "
                     f"{cfg.attention}, recomputation {cfg.recompute_mode}).")
        return lines
    for t in model.transformers:
        b, s, h, n_layers = cfg.batch_size, cfg.seq_len, t.hidden_size, t.num_layers
        naive = b * s * h * n_layers * 4
        lines.append(f"The common rule of thumb counts one fp32 hidden state per layer, b·s·h·L·4 bytes = "
                     f"{fmt_bytes(naive)}: {m.activations / max(naive, 1):.0f}× too small, because each layer "
                     f"saves many b·s·h and b·s·{t.intermediate_size // h}h tensors for backward"
                     + (", plus b·heads·s² scores, probabilities and masks in eager attention." if cfg.attention
                        == "eager" else "; SDPA/flash kernels avoid the s² tensors."))
    if cfg.checkpointing:
        lines.append("With checkpointing each layer keeps only its input; backward recomputes one layer at a time, "
                     "so one layer's full activations come back at the backward peak (~1/3 more compute).")
    return lines


# What each optimizer keeps per parameter tensor (planner.memory.optimizer has the byte formulas).
OPTIMIZER_STATES = {
    "adamw": "two tensors per parameter, exp_avg and exp_avg_sq, in the parameters' dtype",
    "adam": "two tensors per parameter, exp_avg and exp_avg_sq, in the parameters' dtype",
    "sgd": "no state kept",
    "sgd-momentum": "one momentum_buffer per parameter, in the parameters' dtype",
    "adafactor": "a row and a column vector per matrix (a full tensor per vector parameter), fp32",
    "adamw-8bit": "two 8-bit tensors per parameter plus fp32 scales per block of 256 (bitsandbytes)",
}


def _state_lines(est: Estimate) -> list[str]:
    m, cfg = est.memory_bytes, est.config
    where = where_states_live(est)
    what = OPTIMIZER_STATES.get(cfg.optimizer, "the states this optimizer keeps")
    from planner.memory.framework_layout import layout

    if layout(cfg).accumulate_unsharded:  # FSDP's no_sync() during accumulation (planner.parallel.frameworks)
        grads = (f"Gradients: {fmt_bytes(m.gradients)} on each GPU: the framework accumulates inside FSDP's "
                 "no_sync(), so every unit's gradient is kept whole (unsharded, in the 16-bit compute dtype) "
                 "until the last micro-step reduce-scatters it; the optimizer then steps the shards, cast to the "
                 "parameters' dtype.")
    else:
        grads = (f"Gradients: {fmt_bytes(m.gradients)} {where}. They have the parameters' dtype and, with "
                 "gradient accumulation, stay allocated across micro-steps.")
    return [grads,
            f"Optimizer states ({cfg.optimizer}: {what}): {fmt_bytes(m.optimizer_states)} {where}, allocated at "
            "the first optimizer.step(). Rules of thumb that count only parameters and activations leave them "
            "out."]


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
    lines.append(f"Input batch in all: {fmt_bytes(est.memory_bytes.batch)} {batch_where(est)}.")
    return lines


PHASE_LABELS = {"buffers": "temporaries and buffers"}  # JSON key `buffers`: DDP buckets, workspaces, casts


def _phase_lines(est: Estimate) -> list[str]:
    m = est.memory_bytes
    lines = []
    for ph in est.phases:
        parts = ", ".join(f"{PHASE_LABELS.get(k, k.replace('_', ' '))} {fmt_bytes(v)}"
                          for k, v in ph.detail.items() if v)
        lines.append(f"{ph.phase:<10} {fmt_bytes(ph.allocated):>11}  ({parts})")
    note = phase_moment_note(est)
    if note:
        lines.append(note)
    lines += loop_lines(est)
    # the allocator replay's own ratio where it ran (the runtime record's is the flat default it replaces)
    frag = m.peak_reserved / m.peak_allocated - 1 if est.allocator is not None and m.peak_allocated else \
        est.runtime.fragmentation
    lines.append(f"Peak allocated {fmt_bytes(m.peak_allocated)} in {est.peak_phase}; the caching allocator reserves "
                 f"{fmt_bytes(m.peak_reserved)} (fragmentation {frag:.0%}); plus CUDA context "
                 f"{fmt_bytes(m.cuda_context)} and NCCL {fmt_bytes(m.nccl)} = {fmt_bytes(m.peak_device)} on the device.")
    return lines


def loop_lines(est: Estimate) -> list[str]:
    """What --loop and --load (planner.memory.loops) change in the phases, when not the defaults."""
    from planner.memory import loops

    cfg, out = est.config, []
    words = {"forward-end": "when the forward returns", "step-end": "after the optimizer step",
             "next-forward": "when the next step's forward returns", "next-backward":
             "after the next step's forward, before its backward"}
    if cfg.loop != loops.DEFAULT_LOOP:
        r = loops.rule(cfg.loop)
        out.append(f"Loop {cfg.loop}: the model's outputs are freed {words[r.outputs_die]}, the gradients "
                   f"{words[r.grads_die]}.")
    build = next((ph for ph in est.phases if ph.phase == "load"), None)
    if cfg.load == "cast" and build is not None and build.allocated > est.memory_bytes.parameters:
        out.append(f"Load cast: the model is built in fp32 ({fmt_bytes(build.allocated)}) and then cast; the fp32 "
                   f"blocks stay cached, so their segments stay reserved through training.")
    return out


def phase_moment_note(est: Estimate) -> str | None:
    """Why a phase row can show less (or more) than the term above it: a row is one moment, that phase's
    highest point.

    Backward creates gradients block by block and frees activations block by block, so at the backward peak
    only the first blocks' gradients exist; the forward/backward peak falls while a block runs, before the
    last saved tensors are made or after the first are freed. The phase rows' activations also count the
    model's outputs the training loop still holds (logits, loss: planner.memory.timeline `retained_bytes`),
    which are not saved for backward; they are what is left at the optimizer step."""
    m = est.memory_bytes
    by_phase = {ph.phase: ph for ph in est.phases}
    peak = by_phase.get(est.peak_phase)
    if peak is None:
        return None
    opt = by_phase.get("optimizer")
    outputs = opt.detail.get("activations", 0) if opt is not None and est.peak_phase != "optimizer" else 0
    gaps = []
    grads_at_peak = peak.detail.get("gradients", 0)
    if fmt_bytes(grads_at_peak) != fmt_bytes(m.gradients):
        gaps.append(f"gradients {fmt_bytes(grads_at_peak)} of {fmt_bytes(m.gradients)}")
    saved_at_peak = max(peak.detail.get("activations", 0) - outputs, 0)
    if fmt_bytes(saved_at_peak) != fmt_bytes(m.activations):
        gaps.append(f"activations saved for backward {fmt_bytes(saved_at_peak)} of {fmt_bytes(m.activations)}")
    lines = []
    if gaps:
        lines.append(f"Each phase row is one moment, that phase's highest point, not the phase's total: at the "
                     f"{est.peak_phase} peak there are {' and '.join(gaps)}, because backward creates gradients "
                     "and frees activations block by block (all gradients exist only at the optimizer step).")
    if outputs:
        lines.append(f"The phase rows' activations also hold the model's outputs ({fmt_bytes(outputs)}: logits "
                     "and loss, kept by the training loop until the step ends), which are not saved for backward "
                     "and so not in 'activations (saved for backward)'.")
    return " ".join(lines) or None


def _fixes(model: ModelSpec | str, est: Estimate, model_options: dict[str, Any] | None,
           extra: dict[str, Any] | None = None) -> list[tuple[str, Estimate]]:
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
    if cfg.lora and cfg.base_dtype != "nf4":
        tries.append(("a 4-bit base (QLoRA, --base-dtype nf4)", {"base_dtype": "nf4"}))
    if strategy_of(cfg.parallelism).ddp_buckets and not strategy_of(cfg.parallelism).shards \
            and not cfg.gradient_as_bucket_view:
        tries.append(("DDP gradient_as_bucket_view=True", {"gradient_as_bucket_view": True}))
    if est.world_size > 1:
        for z in ("zero1", "zero2", "zero3"):
            if z != cfg.parallelism:
                tries.append((f"{z} sharding", {"parallelism": z}))
    if est.parallel is not None:  # more tensor or pipeline parallelism, recomputation, sharded optimizer
        from planner.explain_parallel import fix_tries

        tries += fix_tries(est, inst.gpus)
        # full recomputation is the model-parallel try (it clears --recompute selective as well)
        tries = [t for t in tries if t[0] != "activation checkpointing"]
    found = []
    for label, change in tries:
        try:
            alt = estimate(model, TrainConfig(**(cfg.model_dump() | change)), inst, model_options=model_options,
                           runtime=_same_runtime(est), stack=est.stack, **(extra or {}))
        except (PlannerError, ValidationError):  # a fix past a limit (grad-accum > 65,536) is no fix
            continue
        if alt.fits:
            found.append((label, alt))
    found.sort(key=lambda x: -(x[1].throughput.samples_per_s if x[1].throughput else 0))
    return found


def _largest_fitting_batch(model, est: Estimate, model_options, extra: dict[str, Any] | None = None) -> int | None:
    from planner.estimate import estimate

    cfg, lo = est.config, est.config.batch_size
    hi = lo
    while True:
        alt = estimate(model, cfg.model_copy(update={"batch_size": hi * 2}), est.instance,
                       model_options=model_options, with_throughput=False, stack=est.stack,
                       runtime=_same_runtime(est), **(extra or {}))
        if not alt.fits or hi > 4096:
            break
        hi *= 2
    lo, hi = hi, hi * 2  # lo fits, hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if estimate(model, cfg.model_copy(update={"batch_size": mid}), est.instance, model_options=model_options,
                    with_throughput=False, stack=est.stack, runtime=_same_runtime(est), **(extra or {})).fits:
            lo = mid
        else:
            hi = mid
    return lo


def _verdict_lines(model: ModelSpec | str, est: Estimate, model_options, extra: dict[str, Any] | None = None,
                   found: list[dict[str, Any]] | None = None) -> list[str]:
    """The verdict in words; the fixes that fit are also appended to `found`, as figures."""
    found = [] if found is None else found
    m = est.memory_bytes
    if est.fits:
        lines = [f"FITS: {fmt_bytes(m.peak_device)} of {fmt_bytes(est.gpu_memory_bytes)} at the peak "
                 f"({est.peak_phase}); headroom {fmt_bytes(est.headroom_bytes)} "
                 f"({est.headroom_bytes / est.gpu_memory_bytes:.0%})."]
        if est.headroom_bytes < 0.05 * est.gpu_memory_bytes:
            lines.append("Headroom is under 5%: fragmentation or a longer batch can still OOM; leave a margin.")
        with many_batches():  # a traced model: two traces, then every micro-batch interpolated (issue 38)
            best = _largest_fitting_batch(model, est, model_options, extra)
        found.append({"largest_fitting_batch_size": best})
        if best:
            lines.append(f"The largest micro-batch that fits with these settings: {best}.")
        return lines
    lines = [f"OUT OF MEMORY: {fmt_bytes(m.peak_device)} needed at the {est.peak_phase} peak, "
             f"{fmt_bytes(est.gpu_memory_bytes)} on the GPU ({fmt_bytes(-est.headroom_bytes)} short)."]
    if est.verdict == "tight":  # not a sure fit: the band of the runtime terms crosses the GPU's memory
        lines = [f"TIGHT: {fmt_bytes(est.peak_device_low_bytes)} to {fmt_bytes(est.peak_device_high_bytes)} at the "
                 f"{est.peak_phase} peak (point {fmt_bytes(m.peak_device)}), {fmt_bytes(est.gpu_memory_bytes)} on "
                 "the GPU: it may fit or OOM (see the step before); a probe settles it."]
    with many_batches():
        fixes = _fixes(model, est, model_options, extra)
    if not fixes:
        tried = "smaller micro-batch with accumulation, checkpointing, AMP, ZeRO" + (
            ", more tensor or pipeline parallelism, recomputation, the distributed optimizer" if est.parallel else "")
        lines.append(f"No single change tried ({tried}) fits;"
                     " combine them or use a GPU with more memory (see `planner search --instance all`).")
    for label, alt in fixes[:5]:
        speed = f", {alt.throughput.samples_per_s:,.1f} samples/s" if alt.throughput else ""
        lines.append(f"fits with {label}: peak {fmt_bytes(alt.memory_bytes.peak_device)}, headroom "
                     f"{fmt_bytes(alt.headroom_bytes)}{speed}")
        found.append({"change": label, "config": alt.config.model_dump(mode="json"),
                      "peak_device_bytes": alt.memory_bytes.peak_device, "headroom_bytes": alt.headroom_bytes,
                      "samples_per_s": alt.throughput.samples_per_s if alt.throughput else None})
    return lines


def _assumption_lines(spec: ModelSpec, est: Estimate, model_options: dict[str, Any] | None,
                      requested: str | None) -> list[str]:
    cfg, world = est.config, est.world_size
    opts = ", ".join(f"{k}={v}" for k, v in (model_options or {}).items()) or "defaults"
    chosen = cfg.parallelism if requested in (None, cfg.parallelism) else f"{requested} → {cfg.parallelism}"
    # under tensor/context/pipeline parallelism the batch is split over the data-parallel replicas only
    replicas, who = (est.parallel.dp, "data-parallel replica(s)") if est.parallel else (world, "GPU(s)")
    recompute = cfg.recompute_mode if cfg.recompute_mode != "selective" else \
        "selective (" + (",".join(cfg.recompute_modules) or "default modules") + ")"
    return [f"Model: {est.model} ({spec.description or 'from its config'}); model options: {opts}.",
            f"Batch: {cfg.batch_size} samples per GPU (micro-batch) × {cfg.grad_accum} accumulation step(s) × "
            f"{replicas} {who} = {cfg.batch_size * cfg.grad_accum * replicas} samples per optimizer step (global).",
            f"Sequence: {cfg.seq_len} tokens per sample. Precision: {cfg.precision}. Optimizer: {cfg.optimizer} "
            f"({cfg.optimizer_impl}). Attention: {cfg.attention}. Activation checkpointing: "
            f"{'on' if cfg.checkpointing else 'off'}." + (f" Recomputation: {recompute}."
                                                           if cfg.recompute_mode == "selective" else ""),
            f"Parallelism: {chosen} over {world} GPU(s) on {cfg.instances} × {est.instance}.",
            f"Stack: PyTorch eager training with the CUDA caching allocator; runtime memory from "
            f"{est.runtime.source}."]


def _same_runtime(est: Estimate) -> dict[str, Any] | None:
    """The runtime overrides of `est` (--cuda-context-mib, --fragmentation) for a re-run of another
    configuration, so that its figures are those `estimate` gives that configuration with the same flags.
    Not `est.runtime` itself: whole RuntimeConstants count as given, which switches the allocator replay off
    and narrows the band (explain's DataParallel column said 4.74 GiB where `estimate --parallelism dp` says
    4.56)."""
    from planner.memory.runtime import FIELDS, overridden_fields

    given = overridden_fields(est.runtime)
    return {k: v for k, v in given.items() if k in FIELDS} or None


def _ddp_vs_dp_lines(model: ModelSpec | str, est: Estimate, model_options: dict[str, Any] | None,
                     extra: dict[str, Any] | None = None, figures: dict[str, Any] | None = None) -> list[str]:
    """`auto` picks DDP; the question users ask is often about nn.DataParallel: answer both, side by side
    (the DataParallel column's figures also go into `figures`)."""
    from planner.estimate import estimate

    try:
        dp = estimate(model, est.config.model_copy(update={"parallelism": "dp"}), est.instance,
                      runtime=_same_runtime(est), model_options=model_options, stack=est.stack, **(extra or {}))
    except (PlannerError, ValidationError):  # no such configuration: no column
        return []
    if figures is not None:
        figures.update({"ddp": _estimate_figures(est), "dp": _estimate_figures(dp)})
    rows = [("parameters", "parameters"), ("gradients", "gradients"), ("optimizer states", "optimizer_states"),
            ("activations", "activations"), ("input batch", "batch"), ("temporaries and buffers", "buffers"),
            ("peak on the device", "peak_device")]
    lines = ["`auto` chose DistributedDataParallel (one process per GPU), not nn.DataParallel: PyTorch recommends "
             "DDP even on one machine (torch.nn.DataParallel documentation), because DataParallel runs one "
             "process, keeps gradients and optimizer on GPU 0, and copies the model every step.",
             "Both, per GPU (DataParallel: GPU 0, the fullest; --parallelism dp explains it alone):",
             f"{'':<26}{'DDP':>12}{'DataParallel':>14}"]
    for label, key in rows:
        lines.append(f"{label:<26}{fmt_bytes(getattr(est.memory_bytes, key)):>12}"
                     f"{fmt_bytes(getattr(dp.memory_bytes, key)):>14}")
    lines.append(f"{'verdict':<26}{'fits' if est.fits else 'OOM':>12}{'fits' if dp.fits else 'OOM':>14}")
    if est.throughput and dp.throughput:
        lines.append(f"{'samples/s (job)':<26}{est.throughput.samples_per_s:>12,.1f}"
                     f"{dp.throughput.samples_per_s:>14,.1f}")
    return lines


def _estimate_figures(est: Estimate) -> dict[str, Any]:
    """The headline numbers of one estimate, under the keys of `estimate --json`."""
    tp = est.throughput
    return {"memory_bytes": est.memory_bytes.model_dump(), "verdict": est.verdict, "fits": est.fits,
            "peak_device_low_bytes": est.peak_device_low_bytes, "peak_device_high_bytes": est.peak_device_high_bytes,
            "headroom_bytes": est.headroom_bytes,
            "samples_per_s": tp.samples_per_s if tp else None}


def _figures(est: Estimate) -> dict[str, dict[str, Any]]:
    """The numbers of each step, by the step they belong to (the side-by-side and verdict steps fill theirs as
    they compute them). Named rather than listed in step order: a step that only some runs have (adapters, a
    run of lengths, DDP beside DataParallel) must not shift the numbers of the steps after it."""
    j = est.to_json()
    m = j["memory_bytes"]
    tp = j.get("throughput") or {}
    return {
        "assumptions": {"config": j["config"], "world_size": est.world_size, "instance": est.instance,
                        "stack": j.get("stack"), "cost": j.get("cost")},
        "gpu": {"gpus_per_instance": None, "gpu_memory_bytes": est.gpu_memory_bytes,
                "cuda_context_bytes": m["cuda_context"], "nccl_bytes": m["nccl"],
                "usable_memory_bytes": est.usable_memory_bytes},
        "storage": {"parallelism": est.config.parallelism, "parameters_bytes": m["parameters"],
                    "gradients_bytes": m["gradients"], "optimizer_states_bytes": m["optimizer_states"]},
        "components": {"parameters": dict(est.parameters)},
        "precision": {"parameters_bytes": m["parameters"]},
        "states": {"gradients_bytes": m["gradients"], "optimizer_states_bytes": m["optimizer_states"]},
        "adapters": {"lora_r": est.config.lora_r, "lora_alpha": est.config.lora_alpha,
                     "lora_targets": list(est.config.lora_targets), "base_dtype": est.config.base_dtype},
        "activations": {"activations_bytes": m["activations"]},
        "data": {"batch_bytes": m["batch"]},
        "phases": {"phases": j["phases"], "peak_phase": est.peak_phase, "peak_allocated_bytes": m["peak_allocated"]},
        "beyond": {"memory_bytes": m, "peak_device_low_bytes": est.peak_device_low_bytes,
                   "peak_device_high_bytes": est.peak_device_high_bytes, "band": j.get("band")},
        "verdict": {"verdict": est.verdict, "fits": est.fits, "peak_device_bytes": m["peak_device"],
                    "peak_device_low_bytes": est.peak_device_low_bytes,
                    "peak_device_high_bytes": est.peak_device_high_bytes, "gpu_memory_bytes": est.gpu_memory_bytes,
                    "headroom_bytes": est.headroom_bytes, "peak_phase": est.peak_phase,
                    "samples_per_s": tp.get("samples_per_s"), "step_time_s": tp.get("step_time_s"),
                    "mfu": tp.get("mfu"), "breakdown_s": tp.get("breakdown_s"), "cost": j.get("cost")},
    }


def explain(est: Estimate, model: ModelSpec | str | None = None,
            model_options: dict[str, Any] | None = None, requested_parallelism: str | None = None,
            inputs: str | None = None, loss: str | None = None, run: Any = None) -> list[Step]:
    """The steps; `requested_parallelism` is what the user asked for (`auto` adds DDP vs DataParallel).
    `run`: the `planner.run.simulate.RunRequest` behind `est.run` (its step weighs the run's fixes).
    A traced model (`file.py:build` with `inputs`/`loss`, or a config.json outside the families) explains
    its components, activations and batch from the trace (`planner.explain_traced`)."""
    from planner.estimate import _resolve_model
    from planner.hardware import get_instance
    from planner.models.user_module import is_reference
    from planner.program.sources import is_traced_config

    extra: dict[str, Any] = {}
    if is_reference(model) or is_traced_config(model):
        from planner import explain_traced

        extra = {"inputs": inputs, "loss": loss}
        spec: Any = explain_traced.TracedView(str(model), est, model_options, inputs, loss)
    else:
        spec = _resolve_model(model or est.model, model_options)
    inst = get_instance(est.instance)
    g = inst.gpu
    rt = est.runtime
    both = (requested_parallelism == "auto" and est.config.parallelism == AUTO_MULTI_GPU and est.config.instances == 1
            and est.world_size > 1)
    figures = _figures(est)
    figures["gpu"]["gpus_per_instance"] = inst.gpus
    if est.config.lora and not extra:  # the targets and base storage as resolved (peft's defaults named)
        from planner.adapters.lora import plan

        lora = plan(spec, est.config)
        figures["adapters"].update(lora_targets=list(lora.targets), base_dtype=lora.base_dtype)
    side: dict[str, Any] = {}
    side_by_side = [Step("DDP, which auto chose, and nn.DataParallel side by side",
                         tuple(_ddp_vs_dp_lines(model or est.model, est, model_options, extra, side)), side)
                    ] if both else []
    fixes: list[dict[str, Any]] = []
    verdict_lines = tuple(_verdict_lines(model or est.model, est, model_options, extra, fixes))
    if fixes and "largest_fitting_batch_size" in fixes[0]:
        figures["verdict"].update(fixes.pop())
    else:
        figures["verdict"]["fixes"] = fixes
    run_step = _run_step(model or est.model, est, run, model_options, extra)
    f = figures
    return [
        Step("Assumptions", tuple(_assumption_lines(spec, est, model_options, requested_parallelism))
             + tuple(_price_lines(est)), f["assumptions"]),
        Step(f"Memory of each GPU on {inst.name}", (
            f"{inst.gpus} × {g.name}, {fmt_bytes(g.memory_bytes)} nominal, {fmt_bytes(est.gpu_memory_bytes)} as the "
            "driver reports it; GPUs do not pool memory: each must hold its own share.",
            f"Not all of it is for tensors: CUDA context {fmt_bytes(rt.cuda_context_bytes)}, NCCL buffers "
            f"{fmt_bytes(est.memory_bytes.nccl)} sit outside PyTorch's allocator, so "
            f"{fmt_bytes(est.usable_memory_bytes)} is usable. Interconnect: {inst.interconnect}.",
        ), f["gpu"]),
        *_parallel_step(est, inst.gpus),
        Step(f"How the model is stored under {est.config.parallelism}", tuple(_storage_lines(est)), f["storage"]),
        *side_by_side,
        Step("Parameters of each component", tuple(spec.component_lines() if extra else _component_lines(spec)) +
             (f"Total: {est.parameters['total']:,} ({fmt_count(est.parameters['total'])}).",), f["components"]),
        Step("Their storage at each precision", tuple(_precision_lines(est)), f["precision"]),
        Step("Gradients and optimizer states", tuple(_state_lines(est)), f["states"]),
        *_adapter_step(model or est.model, est, model_options, extra, f["adapters"]),
        Step('The "computational graph": saved activations',
             tuple(spec.activation_lines() if extra else _activation_lines(spec, est)), f["activations"]),
        Step("How parameters and data are stored", tuple(spec.data_lines() if extra else _data_lines(spec, est)),
             f["data"]),
        Step("Total by phase of one step", tuple(_phase_lines(est)), f["phases"]),
        Step("What the GPU holds beyond your tensors", tuple(_beyond_tensors_lines(est)), f["beyond"]),
        *run_step,
        Step("Verdict", verdict_lines + _speed_bound_lines(est)
             + _amp_lines(model or est.model, est, model_options, extra, f["verdict"]), f["verdict"]),
    ]


def _parallel_step(est: Estimate, gpus_per_instance: int) -> list[Step]:
    """Tensor, context, pipeline and data parallelism, each dimension's effect (planner.explain_parallel)."""
    if est.parallel is None:
        return []
    from planner.explain_parallel import parallel_lines

    return [Step("How the GPUs split the model (tensor, context, pipeline, data)",
                 tuple(parallel_lines(est, gpus_per_instance)), est.parallel.model_dump(mode="json"))]


def _price_lines(est: Estimate) -> list[str]:
    """Where the cost's price comes from (region, date, source, staleness), as `estimate` and `search` say it."""
    if est.cost is None:
        return []
    from planner.prices import cost_provenance

    return [f"Cost: ${est.cost.price_per_hour:,.2f}/hour for the job's "
            f"{est.config.instances} instance{'s' if est.config.instances != 1 else ''} "
            f"({cost_provenance(est.cost, hint=True)})."]


def _run_step(model, est: Estimate, run: Any, model_options, extra) -> list[Step]:
    """The run of varying lengths (`planner.run.explain_run`), when there is one."""
    if est.run is None or run is None:
        return []
    from planner.estimate import estimate
    from planner.run import explain_run

    lines = explain_run.lines(model, est, run, model_options, extra, estimate_fn=estimate)
    return [Step("A run of varying lengths", tuple(lines),
                 {"run": est.run.model_dump(mode="json")})]


def _adapter_step(model: Any, est: Estimate, model_options: dict[str, Any] | None, extra: dict[str, Any],
                  figures: dict[str, Any]) -> list[Step]:
    """A LoRA / QLoRA run: where its memory goes, what a change of rank, targets, base or checkpointing does."""
    if not est.config.lora or extra:
        return []
    from planner.adapters.explain import adapter_lines
    from planner.estimate import estimate

    lines = adapter_lines(model, est, model_options, estimate_fn=estimate)
    return [Step("Adapters on a frozen base (LoRA)", tuple(lines), figures)]


def _beyond_tensors_lines(est: Estimate) -> list[str]:
    """Context, workspaces, NCCL, the reserved pool and the band: the runtime terms, with the stack named and
    why each has the size and the uncertainty it has (planner.memory.stack, planner.memory.band)."""
    from planner.memory.stack import describe, lazy_loading, workspace_rule

    m, terms = est.memory_bytes, {t.name: t for t in est.band}
    lines = []
    if est.stack:
        lines.append(f"Software stack: {describe(est.stack)} ({est.stack.source}).")

    def rng(name: str) -> str:
        t = terms.get(name)
        return "" if t is None or t.low == t.high else f" (could be {fmt_bytes(t.low)} to {fmt_bytes(t.high)})"

    ctx = terms.get("cuda_context")
    how = (" CUDA loads kernels lazily, on first use: the context holds the driver, the runtime and only the "
           "kernels this step calls." if est.stack and lazy_loading(est.stack) else
           " Without lazy loading every kernel of libtorch_cuda, cuBLAS and cuDNN for this GPU is loaded into "
           "the context at start, used or not.")
    lines.append(f"CUDA context {fmt_bytes(m.cuda_context)}{rng('cuda_context')}: outside PyTorch's allocator, "
                 "so torch.cuda.memory_reserved() never shows it but nvidia-smi does." + how +
                 (f" Why this size: {ctx.basis}." if ctx else ""))
    ws = terms.get("workspaces")
    if ws and est.stack:
        rule = workspace_rule(est.stack)
        where = "from the caching allocator" if rule["in_allocator"] else "inside cuBLAS, outside the allocator"
        lines.append(f"cuBLAS/cuBLASLt workspaces {fmt_bytes(ws.point)}{rng('workspaces')}: one per cuBLAS handle "
                     f"(forward thread and autograd's device thread), {where} in torch {est.stack.torch} "
                     "(CUBLAS_WORKSPACE_CONFIG; counted in temporaries and buffers).")
    lines.append(f"NCCL buffers {fmt_bytes(m.nccl)}{rng('nccl')}" + (
        ": FIFO buffers per channel and ring peer, outside the allocator; the channel count depends on the "
        "topology." if m.nccl else ": none, one process does not talk to another GPU."))
    pool = m.peak_reserved - m.peak_allocated
    line = (f"Reserved pool: the caching allocator holds {fmt_bytes(m.peak_reserved)} at the peak for "
            f"{fmt_bytes(m.peak_allocated)} allocated, {fmt_bytes(pool)} more{rng('reserved_pool')}. ")
    a = est.allocator
    if a is not None:
        line += (f"Replaying the step's tensors through its rules ({a.events:,} events, {a.segments} segments): "
                 f"the reserved peak was set by {a.peak_allocation} ({fmt_bytes(a.peak_allocation_bytes)}), which "
                 f"found no cached free block large enough (earlier frees left split, smaller blocks) and made "
                 f"the allocator reserve a new {fmt_bytes(a.peak_segment_bytes)} "
                 f"{'range of expandable pages' if a.expandable_segments else 'segment'}.")
        if a.oom_retry:
            line += (" Near the limit it had to free its cached segments and retry (the empty_cache path real "
                     "runs survive on)" + ("; even then it would not fit." if a.oom_after_retry else "."))
    else:
        line += (f"No allocator replay here: the flat assumption reserved = allocated × "
                 f"(1 + {est.runtime.fragmentation:.0%}) (freed blocks are cached, large ones rounded to 2 MiB "
                 "segments and split, so reserved sits above allocated).")
    lines.append(line)
    gap = terms.get("unexplained_gap")
    if gap is not None and gap.high > 0:
        lines.append(f"Unexplained gap 0 B to {fmt_bytes(gap.high)}: whole-GPU peaks published for torch 1.x runs "
                     f"(Lambda's BERT logs, nvidia-smi) sit up to {gap.high / max(m.peak_device, 1):.0%} above "
                     "this model, and nothing it counts explains why (NVIDIA's TorchScript GELU, apex and torch "
                     "1.x allocator behaviour are suspects). A probe on this stack settles it.")
    lines.append(f"The whole device: {fmt_bytes(est.peak_device_low_bytes)} to {fmt_bytes(est.peak_device_high_bytes)}"
                 f" (point {fmt_bytes(m.peak_device)}) of {fmt_bytes(est.gpu_memory_bytes)}: verdict "
                 f"{est.verdict.upper()}. Your tensors are exact; the band is the sum of these terms' ranges. "
                 "A probe run on the GPU and `planner calibrate` narrow it for this GPU family.")
    return lines


def _amp_lines(model: ModelSpec | str, est: Estimate, model_options: dict[str, Any] | None,
               extra: dict[str, Any] | None, figures: dict[str, Any]) -> tuple[str, ...]:
    """An fp32 step on a GPU with 16-bit tensor cores: say what AMP would give, by the planner's own
    estimate of the same configuration in AMP (on a V100 about 4x the samples/s), since a faster GPU is the
    costly answer and AMP the cheap one."""
    from planner.estimate import estimate
    from planner.hardware import get_instance

    gpu = get_instance(est.instance).gpu
    if est.config.precision != "fp32" or est.throughput is None or not {"fp16", "bf16"} & set(gpu.peak_tflops):
        return ()
    amp = "amp-bf16" if gpu.bf16 else "amp-fp16"
    try:
        alt = estimate(model, est.config.model_copy(update={"precision": amp}), est.instance,
                       model_options=model_options, runtime=_same_runtime(est), stack=est.stack, **(extra or {}))
    except (PlannerError, ValidationError):  # no such configuration: no advice
        return ()
    if alt.throughput is None or alt.throughput.samples_per_s <= est.throughput.samples_per_s:
        return ()
    gain = alt.throughput.samples_per_s / est.throughput.samples_per_s
    figures["amp"] = {"precision": amp, "samples_per_s": alt.throughput.samples_per_s, "speedup": gain,
                      "peak_device_bytes": alt.memory_bytes.peak_device, "verdict": alt.verdict}
    return (f"AMP: this step is fp32, and {gpu.name} has 16-bit tensor cores; --precision {amp} runs its "
            f"matmuls there: {alt.throughput.samples_per_s:,.1f} samples/s instead of "
            f"{est.throughput.samples_per_s:,.1f} ({gain:.1f}x), peak {fmt_bytes(alt.memory_bytes.peak_device)} "
            f"({alt.verdict}).",)


def _speed_bound_lines(est: Estimate) -> tuple[str, ...]:
    """What bounds the step's speed: the share of its time in kernels limited by bytes rather than FLOPs
    (planner.perf.roofline), so the user knows whether HBM bandwidth or FLOP/s buys more speed."""
    t = est.throughput
    if t is None or "bytes_bound_s" not in t.breakdown_s:
        return ()
    b = t.breakdown_s
    share = b["bytes_bound_s"] / t.step_time_s
    cpu = b.get("launch_overhead", 0.0) / t.step_time_s
    if cpu >= 0.5:
        head = (f"{cpu:.0%} of this step is launch overhead: the CPU dispatching kernels (and the per-step "
                "host work) sets the pace, so a larger micro-batch costs little extra time.")
    elif share >= 0.5:
        head = (f"{share:.0%} of this step is memory-bound: a GPU with more HBM bandwidth helps more than one "
                "with more FLOPs.")
    else:
        from planner.memory.activations import LOW_DTYPE
        from planner.perf.roofline import on_cuda_cores

        gpu = _known_gpu(est.gpu)  # None for a GPU the table does not hold: then only fp32 is on CUDA cores
        peaks = gpu.peak_tflops if gpu is not None else {}
        cuda_cores = (on_cuda_cores(gpu, LOW_DTYPE[est.config.precision], est.config.tf32) if gpu is not None
                      else est.config.precision == "fp32")
        if not cuda_cores:
            unit = "tensor-core FLOP/s"
        elif "tf32" in peaks:
            unit = "FP32 FLOP/s (fp32 matmuls run on CUDA cores; --tf32 puts them on this GPU's tensor cores)"
        else:
            unit = "FP32 FLOP/s (fp32 matmuls run on CUDA cores; this GPU has no TF32 tensor cores)"
        head = (f"{1 - share - cpu:.0%} of this step is bound by FLOPs ({share:.0%} memory-bound): a GPU with "
                f"more {unit} helps most.")
    kinds = ", ".join(f"{k.replace('_', '-')} {b[k] / t.step_time_s:.0%}" for k in
                      ("gemm", "attention", "memory_bound", "optimizer", "communication", "launch_overhead")
                      if k in b)
    wait = b.get("slowest_gpu_wait_s", 0.0) / t.step_time_s
    waiting = (f" Of communication, {wait:.0%} of the step is the faster GPUs waiting for the slowest (GPUs of one"
               " model differ by a few percent in speed; a synchronous step ends with the slowest)."
               if wait >= 0.005 else "")
    return (f"Speed: {head}", f"Time by kernel kind: {kinds}; MFU {t.mfu:.0%}.{waiting}")
