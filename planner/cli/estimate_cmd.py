"""`planner estimate` and `planner explain`: printing only; the numbers come from `planner.estimate`."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from planner.cli.common import (
    AllocConfOpt,
    AttentionOpt,
    BatchOpt,
    CheckpointingOpt,
    CudaVersionOpt,
    GlobalBatchOpt,
    GradAccumOpt,
    InputsOpt,
    InstanceOpt,
    InstancesOpt,
    JsonOpt,
    LossOpt,
    ModelOpt,
    ModelOptionOpt,
    OptimizerImplOpt,
    OptimizerOpt,
    ParallelismOpt,
    PrecisionOpt,
    SeqOpt,
    Tf32Opt,
    TorchVersionOpt,
    TransformersVersionOpt,
    console,
    handles_errors,
    parse_model_options,
    stack_from_flags,
)
from planner.cli.framework_opts import (
    DsConfigOpt,
    FrameworkOpt,
    ReshardOpt,
    framework_fields,
    framework_flags,
    reshard_fields,
)
from planner.cli.job_flags import declare, same_flags
from planner.cli.loop_opts import LoadOpt, LoopOpt, loop_fields, loop_flags
from planner.cli.lora_opts import (
    BaseDtypeOpt,
    LoraAlphaOpt,
    LoraDropoutOpt,
    LoraROpt,
    LoraTargetsOpt,
    lora_fields,
    lora_flags,
)
from planner.cli.moe_opts import EpOpt, EtpOpt, MoeImbalanceOpt, moe_fields, moe_flags
from planner.cli.options import build_config
from planner.cli.parallel_opts import (
    AccountEmbeddingOpt,
    AccountLossOpt,
    CpOpt,
    DistOptOpt,
    DpReplicasOpt,
    FirstStageOpt,
    GradReduceOpt,
    LastStageOpt,
    PpLayoutOpt,
    PpOpt,
    PpScheduleOpt,
    RecomputeModulesOpt,
    RecomputeOpt,
    SpOpt,
    TpOpt,
    VpOpt,
    parallel_fields,
    parallel_flags,
)
from planner.cli.prices_cmd import PriceRegionOpt
from planner.cli.run_options import LengthsOpt, PaddingOpt, RunSeedOpt, RunStepsOpt, run_lines, run_request
from planner.io import dumps_json
from planner.parallel import is_default
from planner.spec import Estimate
from planner.units import fmt_bytes

DEFAULT_MODEL = "multimodal-bert"
DEFAULT_INSTANCE = "ml.p3.16xlarge"

BucketViewOpt = Annotated[bool, typer.Option("--gradient-as-bucket-view/--no-gradient-as-bucket-view",
                                             help="DDP: gradients as views into the buckets (saves one copy).")]
ContextOpt = Annotated[float | None, typer.Option("--cuda-context-mib", help="Override the CUDA context size.")]
FragOpt = Annotated[float | None, typer.Option("--fragmentation", help="Override reserved/allocated - 1.")]
DatasetOpt = Annotated[int | None, typer.Option("--dataset-size", help="Samples per epoch, for $/epoch.")]
SpotOpt = Annotated[bool, typer.Option("--spot/--on-demand", help="Managed spot price.")]
PlotOpt = Annotated[str | None, typer.Option("--plot", help="Write the memory timeline to FILE.png or FILE.html.")]
# FP8 and torch.compile (issue 35)
Fp8RecipeOpt = Annotated[str | None, typer.Option(
    "--fp8-recipe", help="With --precision fp8: tensorwise, rowwise (torchao), delayed, current, mxfp8 "
    "(Transformer Engine). Default: tensorwise (delayed under megatron).")]
Fp8GatherOpt = Annotated[bool, typer.Option("--fp8-param-gather/--no-fp8-param-gather",
                                            help="FSDP2 all-gathers FP8 weights (torchao).")]
CompileOpt = Annotated[bool, typer.Option("--compile/--no-compile", help="torch.compile the model (Inductor).")]


def run_estimate(model: str, instance: str, batch_size: int | None, global_batch_size: int | None, seq_len: int,
                 precision: str, optimizer: str, optimizer_impl: str, parallelism: str, checkpointing: bool,
                 attention: str, grad_accum: int, instances: int, model_option: list[str] | None,
                 gradient_as_bucket_view: bool = False, cuda_context_mib: float | None = None,
                 fragmentation: float | None = None, dataset_size: int | None = None,
                 spot: bool = False, inputs: str | None = None, loss: str | None = None,
                 stack: dict[str, str] | None = None, tf32: bool = False, region: str = "us-east-1",
                 run=None, lora: dict[str, Any] | None = None) -> Estimate:
    """Flags in, Estimate out: the one path shared by estimate, explain and probe (`lora`: the TrainConfig
    fields of the LoRA flags, `lora_opts.lora_fields`)."""
    from planner.estimate import estimate
    from planner.hardware import get_instance
    from planner.prices import check_region, load_cache

    inst = get_instance(instance)
    region = check_region(region, load_cache())
    config = build_config(instance_gpus=inst.gpus, batch_size=batch_size, global_batch_size=global_batch_size,
                          seq_len=seq_len, precision=precision, optimizer=optimizer, optimizer_impl=optimizer_impl,
                          parallelism=parallelism, checkpointing=checkpointing, attention=attention,
                          grad_accum=grad_accum, instances=instances,
                          gradient_as_bucket_view=gradient_as_bucket_view, tf32=tf32, **(lora or {}))
    from planner.memory.runtime import overrides_from_flags

    overrides = overrides_from_flags(cuda_context_mib, fragmentation)
    return estimate(model, config, inst, runtime=overrides or None, model_options=parse_model_options(model_option),
                    dataset_size=dataset_size, spot=spot, inputs=inputs, loss=loss, stack=stack, region=region,
                    run=run)


def estimate_from_flags(flags: dict[str, Any]) -> tuple[Estimate, Any]:
    """The estimate of `estimate`'s flags (and so of explain's, which are the same), with the run request
    behind it; writes the timeline when --plot asks."""
    f = dict(flags)
    batch_size = f["batch_size"]
    if batch_size is None and f["global_batch_size"] is None:
        batch_size = 8
    run = run_request(f["lengths"], f["padding"], f["run_steps"], f["run_seed"])
    fw = framework_fields(f["framework"], f["ds_config"], f["parallelism"], f["precision"])
    f["parallelism"] = fw.pop("parallelism", f["parallelism"])
    est = run_estimate(f["model"], f["instance"], batch_size, f["global_batch_size"], f["seq_len"], f["precision"],
                       f["optimizer"], f["optimizer_impl"], f["parallelism"], f["checkpointing"], f["attention"],
                       f["grad_accum"], f["instances"], f["model_option"], f["gradient_as_bucket_view"],
                       f["cuda_context_mib"], f["fragmentation"], f["dataset_size"], f["spot"], f["inputs"],
                       f["loss"], stack_from_flags(f["torch_version"], f["cuda_version"], f["transformers_version"],
                                                   f["alloc_conf"]), f["tf32"], f["region"], run,
                       lora_fields(f["lora_r"], f["lora_alpha"], f["lora_targets"], f["lora_dropout"],
                                   f["base_dtype"]) | fw | reshard_fields(f.get("reshard_after_forward")) | loop_fields(f["loop"], f["load"]) | fp8_compile_fields(f)
                       | moe_fields(f.get("ep", 1), f.get("etp", 1), f.get("moe_imbalance", 1.0))
                       | parallel_fields(tp=f["tp"], sp=f["sp"], cp=f["cp"], pp=f["pp"], pp_schedule=f["pp_schedule"],
                                         vp=f["vp"], dp_replicas=f["dp_replicas"],
                                         distributed_optimizer=f["distributed_optimizer"],
                                         grad_reduce_in_fp32=f["grad_reduce_in_fp32"], recompute=f["recompute"],
                                         recompute_modules=f["recompute_modules"],
                                         checkpointing=f["checkpointing"],
                                         first_stage_layers=f.get("first_stage_layers"),
                                         last_stage_layers=f.get("last_stage_layers"),
                                         account_for_embedding=f.get("account_for_embedding", False),
                                         account_for_loss=f.get("account_for_loss", False),
                                         pp_layout=f.get("pp_layout")))
    if f["plot"]:
        from planner.report.timeline_plot import write_timeline

        write_timeline(est, f["plot"], model_options=parse_model_options(f["model_option"]))
    return est, run


def fp8_compile_fields(f: dict[str, Any]) -> dict[str, Any]:
    """The TrainConfig fields of --fp8-recipe, --fp8-param-gather and --compile (issue 35), left out at
    their defaults so that other estimates' configurations stay as they were."""
    out: dict[str, Any] = {}
    if f.get("fp8_recipe") is not None:
        out["fp8_recipe"] = f["fp8_recipe"]
    if f.get("fp8_param_gather"):
        out["fp8_param_gather"] = True
    if f.get("compile"):
        out["compile"] = True
    return out


def _ddp_buckets(est: Estimate) -> bool:
    """Whether this run has DDP's gradient buckets (a DDP-style strategy over several GPUs, without
    gradient_as_bucket_view): single-GPU and DataParallel runs have none, so their legend must not say so."""
    from planner.parallel import known

    strategy = known(est.config.parallelism)
    return bool(strategy and strategy.ddp_buckets and est.world_size > 1 and not est.config.gradient_as_bucket_view)


def print_estimate(est: Estimate) -> None:
    cfg = est.config
    console.print(f"[bold]{est.model}[/] on [bold]{est.instance}[/] ({est.gpu}), {cfg.parallelism} over "
                  f"{est.world_size} GPU(s); micro-batch {cfg.batch_size} × seq {cfg.seq_len}, {cfg.precision}"
                  f"{' (TF32 matmuls)' if cfg.tf32 else ''}, "
                  f"{cfg.optimizer} ({cfg.optimizer_impl}), attention {cfg.attention}, "
                  + ("recompute selective" + (f" ({','.join(cfg.recompute_modules)})" if cfg.recompute_modules
                                              else "") if cfg.recompute_mode == "selective" else
                     f"checkpointing {'on' if cfg.checkpointing else 'off'}")
                  + f", grad-accum {cfg.grad_accum}"
                  f"{'' if cfg.framework == 'pytorch' else ', framework ' + cfg.framework}")
    if est.stack:
        from planner.memory.stack import describe

        console.print(f"Stack: {describe(est.stack)} ({est.stack.source})", highlight=False)
    from planner.cli.tables import Col, print_table
    from planner.explain import PHASE_LABELS, phase_moment_note

    print_table(console, "Parameters", [Col("component", whole=True), Col("parameters", "right", whole=True)],
                [[name, f"{n:,}"] for name, n in est.parameters.items()])

    m = est.memory_bytes
    rows = [("parameters", m.parameters), ("gradients", m.gradients), ("optimizer states", m.optimizer_states),
            ("activations (saved for backward)", m.activations), ("input batch", m.batch),
            ("temporaries and buffers at the peak", m.buffers), ("peak allocated", m.peak_allocated),
            ("peak reserved (+fragmentation)", m.peak_reserved), ("CUDA context", m.cuda_context),
            ("NCCL buffers", m.nccl), ("peak on the device", m.peak_device),
            ("GPU memory", est.gpu_memory_bytes)]
    print_table(console, "Memory of one GPU", [Col("term", min=24), Col("bytes", "right", whole=True),
                                                Col("", "right", whole=True)],
                [[name, f"{value:,}", fmt_bytes(value)] for name, value in rows],
                caption="temporaries and buffers: " + ("DDP gradient buckets, " if _ddp_buckets(est) else "")
                        + "cuBLAS workspaces, optimizer and AMP temporaries (JSON key memory_bytes.buffers)")

    keys = ("parameters", "gradients", "optimizer_states", "activations", "batch", "buffers")
    heads = ("params", "grads", "optim", "activ", "batch", PHASE_LABELS["buffers"])
    print_table(console, "Peak allocated by phase",
                # byte figures are never split across lines: one record per phase when they cannot sit side by side
                [Col("phase", whole=True)] + [Col(h, "right", whole=True) for h in heads]
                + [Col("total", "right", whole=True)],
                [[ph.phase, *(fmt_bytes(ph.detail.get(k, 0)) for k in keys), fmt_bytes(ph.allocated)]
                 for ph in est.phases],
                caption=phase_moment_note(est))

    _print_stages(est)
    for line in run_lines(est):
        console.print(line, highlight=False)
    for line in verdict_lines(est):
        console.print(line, highlight=False)
    if est.throughput:
        t = est.throughput
        console.print(f"Throughput: {t.samples_per_s:,.1f} samples/s, {t.tokens_per_s:,.0f} tokens/s, "
                      f"step {t.step_time_s * 1000:,.1f} ms, MFU {t.mfu:.0%}, global batch {t.global_batch_size:,}")
        if t.gpus > 1:  # what Megatron's and NeMo's tables report: per GPU over the whole job
            console.print(f"  per GPU: {t.tokens_per_s_per_gpu:,.0f} tokens/s over {t.gpus:,} GPUs", highlight=False)
    if est.cost:
        c = est.cost
        line = f"Cost: ${c.price_per_hour:,.2f}/hour, ${c.usd_per_million_samples:,.2f} per million samples"
        if c.usd_per_epoch is not None:
            line += f", ${c.usd_per_epoch:,.2f} and {c.hours_per_epoch:,.2f} h per epoch"
        console.print(line, highlight=False)
        from planner.prices import cost_provenance, stale_hint

        console.print(f"  {cost_provenance(c)}", highlight=False)
        if c.price_stale:
            console.print(f"  {stale_hint(c.price_region)}", highlight=False)
    elif est.throughput:
        console.print(f"Cost: no price for {est.instance} (see `planner prices`)", highlight=False)
    for note in est.notes:
        console.print(f"[dim]note: {note}[/]")


def _print_stages(est: Estimate) -> None:
    """The layout and every pipeline stage's memory per rank (tensor/context/pipeline parallelism, HSDP)."""
    p = est.parallel
    if p is None:
        return
    from planner.cli.tables import Col, print_table

    replicas = f" ({p.dp_replicate} replica groups of {p.dp_shard})" if p.dp_replicate > 1 else ""
    console.print(f"Layout: {p.world} GPUs = tensor {p.tp}{' (+SP)' if p.sp else ''} × context {p.cp} × pipeline "
                  f"{p.pp}{f' (vp {p.vp})' if p.vp > 1 else ''} × data {p.dp}{replicas}; schedule {p.schedule}, "
                  f"{p.micro_batches} micro-batch(es) per step", highlight=False)
    heads = ("stage", "layers", "states", "activ", "in flight", "peak", "verdict")
    rows = [[str(s.stage), str(len(s.layers)), fmt_bytes(s.parameter_bytes + s.gradient_bytes + s.optimizer_bytes),
             fmt_bytes(s.activation_bytes), f"{s.in_flight_micro_batches:g}", fmt_bytes(s.peak_device_bytes),
             s.verdict + (" (worst)" if s.stage == p.worst_stage else "")]
            for s in p.stages]
    print_table(console, "Memory of one rank per pipeline stage",
                [Col(h, "left" if h in ("stage", "verdict") else "right", whole=True) for h in heads], rows,
                caption="states: parameters, gradients and optimizer states; activ: saved for backward, every "
                        "micro-batch in flight; peak: the whole device. The worst stage decides the verdict (JSON "
                        "key parallel.stages)")


def probe_command(est: Estimate) -> str:
    """The `planner probe launch` line that measures this configuration on the real GPU."""
    cfg = est.config
    parts = [f"planner probe launch --model {est.model} --instance {est.instance} --batch-size {cfg.batch_size}",
             f"--seq-len {cfg.seq_len} --precision {cfg.precision} --attention {cfg.attention}"]
    if cfg.checkpointing:
        parts.append("--checkpointing")
    if cfg.grad_accum > 1:
        parts.append(f"--grad-accum {cfg.grad_accum}")
    if not is_default(cfg.parallelism):
        parts.append(f"--parallelism {cfg.parallelism}")
    if cfg.precision == "fp8":  # the probe job runs the same recipe (jobs/fp8_linears.py)
        parts.append(f"--fp8-recipe {cfg.fp8_recipe}" if cfg.fp8_recipe else "")
        parts.append("--fp8-param-gather" if cfg.fp8_param_gather else "")
    return " ".join([p for p in parts if p] + lora_flags(cfg) + framework_flags(cfg) + loop_flags(cfg)
                    + parallel_flags(cfg) + moe_flags(cfg))


def verdict_lines(est: Estimate) -> list[str]:
    """The verdict with its band; when tight, which terms make it so and what settles it."""
    from planner.memory.band import tight_terms

    m, cap = est.memory_bytes, est.gpu_memory_bytes
    word = {"fits": "[bold green]fits[/]", "tight": "[bold yellow]TIGHT[/]", "oom": "[bold red]OOM[/]"}[est.verdict]
    device = est.run.peak_device_bytes if est.run else m.peak_device
    where = f"step {est.run.peak_step} of the run" if est.run else est.peak_phase
    lines = [f"Verdict: {word}: peak {fmt_bytes(device)} (band {fmt_bytes(est.peak_device_low_bytes)} to "
             f"{fmt_bytes(est.peak_device_high_bytes)}) of {fmt_bytes(cap)} (peak in {where}), headroom "
             f"{fmt_bytes(est.headroom_bytes)}"]
    if est.verdict == "tight" and est.band:
        why = "; ".join(f"{t.name.replace('_', ' ')} {fmt_bytes(t.low)} to {fmt_bytes(t.high)} ({t.basis})"
                        for t in tight_terms(est.band, device, cap)[:3])
        lines.append(f"  tight because: {why}")
        lines.append(f"  settle it with a probe on the real GPU: {probe_command(est)}")
        lines.append("  (then `planner calibrate` narrows the band for this GPU family)")
    return lines


def register(app: typer.Typer) -> None:
    @app.command("estimate")
    @handles_errors
    def estimate_cmd(
        model: ModelOpt = DEFAULT_MODEL,
        instance: InstanceOpt = DEFAULT_INSTANCE,
        batch_size: BatchOpt = None,
        global_batch_size: GlobalBatchOpt = None,
        seq_len: SeqOpt = 512,
        precision: PrecisionOpt = "fp32",
        optimizer: OptimizerOpt = "adamw",
        optimizer_impl: OptimizerImplOpt = "foreach",
        parallelism: ParallelismOpt = "auto",
        checkpointing: CheckpointingOpt = False,
        attention: AttentionOpt = "auto",
        grad_accum: GradAccumOpt = 1,
        instances: InstancesOpt = 1,
        model_option: ModelOptionOpt = None,
        gradient_as_bucket_view: BucketViewOpt = False,
        cuda_context_mib: ContextOpt = None,
        fragmentation: FragOpt = None,
        dataset_size: DatasetOpt = None,
        spot: SpotOpt = False,
        region: PriceRegionOpt = "us-east-1",
        tf32: Tf32Opt = False,
        lora_r: LoraROpt = None,
        lora_alpha: LoraAlphaOpt = None,
        lora_targets: LoraTargetsOpt = None,
        lora_dropout: LoraDropoutOpt = 0.0,
        base_dtype: BaseDtypeOpt = "auto",
        loop: LoopOpt = "plain",
        load: LoadOpt = "direct",
        framework: FrameworkOpt = "pytorch",
        ds_config: DsConfigOpt = None,
        reshard_after_forward: ReshardOpt = None,
        tp: TpOpt = 1,
        sp: SpOpt = None,
        cp: CpOpt = 1,
        pp: PpOpt = 1,
        pp_schedule: PpScheduleOpt = None,
        vp: VpOpt = 1,
        first_stage_layers: FirstStageOpt = None,
        last_stage_layers: LastStageOpt = None,
        account_for_embedding: AccountEmbeddingOpt = False,
        account_for_loss: AccountLossOpt = False,
        pp_layout: PpLayoutOpt = None,
        dp_replicas: DpReplicasOpt = None,
        distributed_optimizer: DistOptOpt = False,
        grad_reduce_in_fp32: GradReduceOpt = None,
        recompute: RecomputeOpt = None,
        recompute_modules: RecomputeModulesOpt = None,
        ep: EpOpt = 1,
        etp: EtpOpt = 1,
        moe_imbalance: MoeImbalanceOpt = 1.0,
        torch_version: TorchVersionOpt = None,
        cuda_version: CudaVersionOpt = None,
        transformers_version: TransformersVersionOpt = None,
        alloc_conf: AllocConfOpt = None,
        plot: PlotOpt = None,
        json_out: JsonOpt = False,
        inputs: InputsOpt = None,
        loss: LossOpt = None,
        lengths: LengthsOpt = None,
        padding: PaddingOpt = None,
        run_steps: RunStepsOpt = None,
        run_seed: RunSeedOpt = None,
        fp8_recipe: Fp8RecipeOpt = None,
        fp8_param_gather: Fp8GatherOpt = False,
        compile: CompileOpt = False,
    ) -> None:
        """Per-GPU memory of one training step by phase, the OOM verdict, throughput and cost."""
        est, _ = estimate_from_flags(locals())
        if json_out:
            from planner.estimate import program

            out = est.to_json()
            out["program"] = program(model, est, model_options=parse_model_options(model_option), inputs=inputs,
                                     loss=loss)
            print(dumps_json(out, indent=2))
        else:
            print_estimate(est)
            if plot:
                console.print(f"timeline written to {plot}")

    declare(estimate_cmd)  # its flags are the job's: explain, search and sweeps derive theirs (job_flags)

    @app.command("explain")
    @handles_errors
    @same_flags
    def explain_cmd(**flags: Any) -> None:
        """Step by step: GPUs, storage, parameters, precision, gradients, activations, phases, verdict, fixes."""
        from planner.explain import explain

        est, run = estimate_from_flags(flags)
        model, model_option = flags["model"], flags["model_option"]
        json_out = flags["json_out"]
        steps = explain(est, model, model_options=parse_model_options(model_option),
                        requested_parallelism=flags["parallelism"], inputs=flags["inputs"], loss=flags["loss"],
                        run=run)
        if json_out:
            print(dumps_json([{"step": i + 1, "title": s.title, "lines": list(s.lines), "figures": s.figures}
                              for i, s in enumerate(steps)], indent=2))
            return
        import textwrap

        from rich.text import Text

        width = max(console.width - 3, 40)
        for i, s in enumerate(steps, 1):
            console.print(Text(f"\n{i}. {s.title}", style="bold cyan"))
            for line in s.lines:  # wrapped lines keep the indent; no word is cut, no line padded with spaces
                lead = "   " + line[:len(line) - len(line.lstrip(" "))]  # a nested line keeps its indent
                wrapped = textwrap.fill(line.lstrip(" "), width, initial_indent=lead, subsequent_indent=lead,
                                        break_long_words=False, break_on_hyphens=False)
                console.print(Text(wrapped), soft_wrap=True)
        if flags["plot"]:
            console.print(f"timeline written to {flags['plot']}", highlight=False)
