"""`planner probe run|launch|status|collect`, `planner validate`, `planner calibrate`.

Parsing and printing only: requests come from planner.probes.spec, AWS work from planner.aws, files from
planner.probes.store, comparisons from planner.probes.validate / calibrate.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from planner.cli.common import (
    AttentionOpt,
    BatchOpt,
    CheckpointingOpt,
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
    console,
    err_console,
    fail,
    handles_errors,
    parse_model_options,
)
from planner.cli.estimate_cmd import Fp8GatherOpt, Fp8RecipeOpt, fp8_compile_fields
from planner.cli.framework_opts import DsConfigOpt, FrameworkOpt, ReshardOpt
from planner.cli.loop_opts import LoadOpt, LoopOpt
from planner.cli.lora_opts import BaseDtypeOpt, LoraAlphaOpt, LoraDropoutOpt, LoraROpt, LoraTargetsOpt
from planner.cli.moe_opts import EpOpt, EtpOpt, MoeImbalanceOpt, moe_fields
from planner.cli.parallel_opts import (
    AccountEmbeddingOpt,
    AccountLossOpt,
    CpOpt,
    DistOptOpt,
    DpReplicasOpt,
    FirstStageOpt,
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
)
from planner.errors import PlannerError
from planner.io import dumps_json

StudyOpt = Annotated[str | None, typer.Option("--study", help="Optuna study under results/ to take candidates from.")]
TopOpt = Annotated[int, typer.Option("--top", "-k", help="How many of the study's best trials.")]
RegionOpt = Annotated[str | None, typer.Option("--region", help="AWS region (default: AWS_REGION / AWS config).")]
ProfileOpt = Annotated[str | None, typer.Option("--profile", help="AWS profile (default: AWS_PROFILE).")]
JobOpt = Annotated[list[str] | None, typer.Option("--job", help="Only this job name (repeatable).")]
ProbesOpt = Annotated[list[Path] | None, typer.Option(
    "--probes", help="Probe result files or folders (default: results/probes/). Repeatable.")]
WarmupOpt = Annotated[int, typer.Option("--warmup-steps", help="Steps before timing (the first creates states).")]
StepsOpt = Annotated[int, typer.Option("--steps", help="Measured steps after warm-up.")]

# The model-parallel layout (issue 34): `planner estimate`'s own options (planner/cli/parallel_opts.py);
# TrainConfig checks the values, planner.parallel.dims how they combine (planner.probes.spec.make_request),
# before any job starts. The probe job refuses what it cannot run (context parallelism, the distributed
# optimizer) with one line; Megatron's uneven-split flags (--first/--last-stage-layers, --account-for-*,
# --pp-layout) are refused before it (planner.probes.spec.check_split), and an uneven split the job can run
# (torchtitan's, NeMo AutoModel's) travels in the request as `stage_layers`.
LAYOUT_FLAGS = ("tp", "sp", "cp", "pp", "vp", "pp_schedule", "dp_replicas", "distributed_optimizer", "recompute",
                "recompute_modules", "first_stage_layers", "last_stage_layers", "account_for_embedding",
                "account_for_loss", "pp_layout")

PROBE_TIMEOUT_S = 3600  # one local probe: model build + a few steps; generous for big models on slow GPUs
run_process = subprocess.run  # a seam for tests


def _jobs_dir() -> Path:
    from planner.aws.launch import JOBS_DIR

    return Path(os.environ.get("PLANNER_JOBS_DIR", JOBS_DIR))


def build_requests(study: str | None, top: int, model: str | None, instance: str | None, config_args: dict[str, Any],
                   model_option: list[str] | None, warmup: int, steps: int, inputs: str | None = None,
                   loss: str | None = None) -> list[Any]:
    from planner.probes import spec as pspec
    from planner.probes.store import results_dir

    kw = {"warmup_steps": warmup, "measure_steps": steps}
    if study:
        return pspec.requests_from_study(study, top, results_dir(), **kw)
    if not model:
        raise PlannerError("--model", None, "a catalog model, config.json path or FILE.py:build (or --study)")
    if not instance:
        raise PlannerError("--instance", None, "a SageMaker instance type, e.g. ml.g5.xlarge (or --study)")
    if config_args.get("batch_size") is None:
        raise PlannerError("--batch-size", None, "a micro-batch per GPU (or --study to take trials)")
    from planner.cli.options import build_config
    from planner.hardware import get_instance

    config = build_config(instance_gpus=get_instance(instance).gpus, global_batch_size=None, **config_args)
    return [pspec.make_request(model, config, instance, model_options=parse_model_options(model_option),
                               inputs=inputs, loss=loss, **kw)]


# ------------------------------------------------------------------------------------------ local


# The training-configuration flags `probe run` and `probe launch` share (TrainConfig fields).
CONFIG_FLAGS = ("batch_size", "seq_len", "precision", "optimizer", "optimizer_impl", "parallelism", "checkpointing",
                "attention", "grad_accum", "instances", "tf32")


def _config_args(flags: dict[str, Any]) -> dict[str, Any]:
    """The configuration flags of a command's arguments (`locals()` at its start), LoRA's included."""
    from planner.cli.framework_opts import framework_fields, reshard_fields
    from planner.cli.loop_opts import loop_fields
    from planner.cli.lora_opts import lora_fields

    fw = framework_fields(flags.get("framework") or "pytorch", flags.get("ds_config"), flags["parallelism"],
                          flags["precision"])
    args = {k: flags[k] for k in CONFIG_FLAGS} | {"parallelism": fw.pop("parallelism", flags["parallelism"])}
    args |= parallel_fields(**{k: flags[k] for k in LAYOUT_FLAGS}, checkpointing=flags["checkpointing"])
    return args | lora_fields(
        flags.get("lora_r"), flags.get("lora_alpha"), flags.get("lora_targets"), flags.get("lora_dropout") or 0.0,
        flags.get("base_dtype") or "auto") | fw | loop_fields(
        flags.get("loop") or "plain", flags.get("load") or "direct") | _fp8_and_expert_fields(flags) | reshard_fields(
        flags.get("reshard_after_forward"))


def _fp8_and_expert_fields(flags: dict[str, Any]) -> dict[str, Any]:
    """--fp8-recipe / --fp8-param-gather (the job runs them with torchao or Transformer Engine, on a GPU with
    FP8 tensor cores) and --ep / --etp / --moe-imbalance (estimated; the job runs ep 1 and reports ep > 1 as
    unsupported), as `planner estimate` reads them, so the probe line an estimate prints runs as printed."""
    return fp8_compile_fields({k: flags.get(k) for k in ("fp8_recipe", "fp8_param_gather")}) | moe_fields(
        flags.get("ep") or 1, flags.get("etp") or 1, flags.get("moe_imbalance") or 1.0)


def check_torch() -> None:
    """`probe run --local` runs jobs/probe.py with this Python: without torch it can only fail, so say so now."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise PlannerError("probe run --local", f"no torch in {sys.executable}",
                           "PyTorch installed in this Python (pip install torch --index-url "
                           "https://download.pytorch.org/whl/cpu for the CPU build), or `planner probe launch`")


def last_line(text: Any) -> str:
    """The last non-empty line of a traceback or message: the one that says what went wrong."""
    lines = [ln.strip() for ln in str(text or "").splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "no message"


def probe_command(request_file: Path, out_file: Path, *, python: str | None = None,
                  device: str | None = None) -> list[str]:
    """`python jobs/probe.py --request R --out O` (the probe re-launches itself under torchrun for DDP)."""
    cmd = [python or sys.executable, str(_jobs_dir() / "probe.py"), "--request", str(request_file), "--out",
           str(out_file)]
    return cmd + (["--device", device] if device else [])


def run_local(request: Any, *, device: str | None = None, timeout_s: int = PROBE_TIMEOUT_S,
              python: str | None = None) -> dict[str, Any]:
    """Run one request here in a subprocess; returns the stored record (crashes become `error` records)."""
    from planner.probes import store

    req_json = request.to_json()
    req_file = store.save_request(req_json)
    out_file = store.probes_dir() / "tmp" / f"{request.request_id}.out.json"
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.unlink(missing_ok=True)
    cmd = probe_command(req_file, out_file, python=python, device=device)
    err_console.print(f"[dim]$ {' '.join(cmd)}[/]", highlight=False)
    started = time.time()
    try:
        proc = run_process(cmd, capture_output=True, text=True, timeout=timeout_s)
        code, tail = proc.returncode, (proc.stderr or "")[-2000:]
    except subprocess.TimeoutExpired:
        code, tail = None, f"timed out after {timeout_s} s"
    if out_file.is_file():
        from planner.io import read_json

        record = read_json(out_file, "probe result", nonfinite_as_none=True)
        out_file.unlink()
    else:
        record = {"request_id": request.request_id, "status": "error", "phase": "launch",
                  "message": f"probe exited with {code} without a result: {tail.strip()[-500:]}",
                  "model": request.model_name, "config": request.config, "instance": request.instance,
                  "estimate": request.estimate, "model_spec": request.model, "summary": {}, "phases": []}
    record.update(source="local", record_id=f"local-{request.request_id}", instance=request.instance,
                  exit_code=code, wall_s=time.time() - started,
                  collected_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    record.setdefault("world_size", request.world_size)
    store.save_record(record)
    return record


def _gib(v: Any) -> str:
    return "-" if v is None else f"{v / 2**30:.2f}"


def _num(v: Any, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def print_records(records: list[dict[str, Any]]) -> None:
    from planner.cli.tables import Rows
    from planner.probes.validate import config_label

    t = Rows(title="probe results (GiB)")
    for col in ("model", "instance", "config", "status", "device", "peak alloc", "peak resv", "device peak",
                "activations", "samples/s", "pred device", "pred fits"):
        t.add_column(col)
    for r in records:
        s, est = r.get("summary") or {}, r.get("estimate") or {}
        status = str(r.get("status"))
        if r.get("phase") and status != "ok":
            status += f" @{r['phase']}"
        t.add_row(str(r.get("model")), str(r.get("instance")), config_label(r.get("config") or {}), status,
                  str(r.get("gpu_name") or r.get("device") or "-"), _gib(s.get("peak_allocated")),
                  _gib(s.get("peak_reserved")), _gib(s.get("device_peak")),
                  _gib(s.get("activations") if s.get("activations") is not None else s.get("saved_tensor_bytes")),
                  _num(s.get("samples_per_s")), _gib((est.get("memory_bytes") or {}).get("peak_device")),
                  str(est.get("fits", "-")))
    t.print(console)
    for r in records:  # why a probe could not run here (FP8 on a CPU, a missing library, ep > 1...): its one line
        if r.get("status") == "unsupported" and r.get("message"):
            err_console.print(f"{r.get('model')}: unsupported: {last_line(r['message'])}", highlight=False)


# -------------------------------------------------------------------------------------------- AWS


def _aws_factory(profile: str | None, region_flag: str | None) -> Any:
    from planner.aws.session import Aws

    cache: dict[str, Any] = {}

    def get(region: str | None) -> Any:
        r = region_flag or region
        if not r:
            from planner.aws.session import resolve_region

            r = resolve_region(None, profile)
        if r not in cache:
            cache[r] = Aws(r, profile)
        return cache[r]

    return get


def _selected_jobs(study: str | None, job: list[str] | None) -> dict[str, dict[str, Any]]:
    from planner.probes import store

    jobs = store.load_jobs()
    if job:
        jobs = {n: jobs.get(n, {"job_name": n}) for n in job}
    if study:
        jobs = {n: e for n, e in jobs.items() if e.get("study") == study}
    if not jobs:
        raise PlannerError("jobs", "none", "launched probe jobs in results/probes/jobs.json (run `planner probe "
                                           "launch`), or --job NAME")
    return jobs


def register(app: typer.Typer) -> None:
    probe = typer.Typer(help="Measure real memory and speed: run the probe job here or on SageMaker.",
                        no_args_is_help=True, rich_markup_mode=None,  # plain help, as planner.cli.main says
                        context_settings={"max_content_width": 80})
    app.add_typer(probe, name="probe")

    @probe.command("run")
    @handles_errors
    def run_cmd(
        local: Annotated[bool, typer.Option("--local/--no-local", help="Run here (the only mode of `run`).")] = True,
        study: StudyOpt = None,
        top: TopOpt = 3,
        model: ModelOpt = None,  # type: ignore[assignment]
        instance: InstanceOpt = None,  # type: ignore[assignment]
        batch_size: BatchOpt = None,
        seq_len: SeqOpt = 512,
        precision: PrecisionOpt = "fp32",
        optimizer: OptimizerOpt = "adamw",
        optimizer_impl: OptimizerImplOpt = "foreach",
        parallelism: ParallelismOpt = "auto",
        checkpointing: CheckpointingOpt = False,
        attention: AttentionOpt = "sdpa",
        grad_accum: GradAccumOpt = 1,
        instances: InstancesOpt = 1,
        tp: TpOpt = 1,
        sp: SpOpt = None,
        cp: CpOpt = 1,
        pp: PpOpt = 1,
        vp: VpOpt = 1,
        pp_schedule: PpScheduleOpt = None,
        dp_replicas: DpReplicasOpt = None,
        distributed_optimizer: DistOptOpt = False,
        recompute: RecomputeOpt = None,
        recompute_modules: RecomputeModulesOpt = None,
        first_stage_layers: FirstStageOpt = None,
        last_stage_layers: LastStageOpt = None,
        account_for_embedding: AccountEmbeddingOpt = False,
        account_for_loss: AccountLossOpt = False,
        pp_layout: PpLayoutOpt = None,
        fp8_recipe: Fp8RecipeOpt = None,
        fp8_param_gather: Fp8GatherOpt = False,
        ep: EpOpt = 1,
        etp: EtpOpt = 1,
        moe_imbalance: MoeImbalanceOpt = 1.0,
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
        model_option: ModelOptionOpt = None,
        inputs: InputsOpt = None,
        loss: LossOpt = None,
        device: Annotated[str | None, typer.Option("--device", help="Force cpu or cuda:N.")] = None,
        warmup_steps: WarmupOpt = 1,
        steps: StepsOpt = 3,
        timeout: Annotated[int, typer.Option("--timeout", help="Seconds per probe.")] = PROBE_TIMEOUT_S,
        json_out: JsonOpt = False,
    ) -> None:
        """Run jobs/probe.py on this machine for one configuration or a study's best trials."""
        flags = locals()
        from planner.probes import store

        if not local:
            raise PlannerError("--no-local", True, "`planner probe launch` for SageMaker")
        if device is not None and not re.fullmatch(r"cpu|cuda(:\d{1,3})?", device):
            raise PlannerError("--device", device, "cpu, cuda or cuda:N (the probe runs PyTorch on this machine)")
        check_torch()
        from planner.io import number

        number(timeout, "--timeout", low=1, high=7 * 24 * 3600, integer=True)  # seconds; a week at most
        requests = build_requests(study, top, model, instance, _config_args(flags), model_option,
            warmup_steps, steps, inputs, loss)
        records = []
        try:
            for req in requests:
                records.append(run_local(req, device=device, timeout_s=timeout))
        finally:
            if records:
                store.rebuild_parquet()
        if json_out:
            typer.echo(dumps_json(records, default=str))
        else:
            print_records(records)
        failed = [r for r in records if r.get("status") == "error"]
        if failed:  # an OOM is a measurement; a probe that could not run is a failure of the command
            fail(f"{len(failed)} of {len(records)} probe(s) failed; {failed[0].get('record_id')} "
                 f"@{failed[0].get('phase')}: {last_line(failed[0].get('message'))}")

    @probe.command("launch")
    @handles_errors
    def launch_cmd(
        study: StudyOpt = None,
        top: TopOpt = 3,
        role: Annotated[str | None, typer.Option("--role", help="SageMaker execution role ARN.")] = None,
        bucket: Annotated[str | None, typer.Option("--bucket", help="s3://bucket/prefix for code and outputs.")] = None,
        region: RegionOpt = None,
        profile: ProfileOpt = None,
        spot: Annotated[bool, typer.Option("--spot/--on-demand", help="Managed spot training.")] = False,
        max_run_minutes: Annotated[int, typer.Option("--max-run-minutes")] = 30,
        max_wait_minutes: Annotated[int | None, typer.Option("--max-wait-minutes", help="Spot: wait limit.")] = None,
        image: Annotated[str | None, typer.Option("--image", help="Training image URI (default: a DLC).")] = None,
        framework_version: Annotated[str | None, typer.Option("--framework-version")] = None,
        volume_gb: Annotated[int, typer.Option("--volume-gb")] = 30,
        dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the requests; call nothing.")] = False,
        model: ModelOpt = None,  # type: ignore[assignment]
        instance: InstanceOpt = None,  # type: ignore[assignment]
        batch_size: BatchOpt = None,
        seq_len: SeqOpt = 512,
        precision: PrecisionOpt = "fp32",
        optimizer: OptimizerOpt = "adamw",
        optimizer_impl: OptimizerImplOpt = "foreach",
        parallelism: ParallelismOpt = "auto",
        checkpointing: CheckpointingOpt = False,
        attention: AttentionOpt = "sdpa",
        grad_accum: GradAccumOpt = 1,
        instances: InstancesOpt = 1,
        tp: TpOpt = 1,
        sp: SpOpt = None,
        cp: CpOpt = 1,
        pp: PpOpt = 1,
        vp: VpOpt = 1,
        pp_schedule: PpScheduleOpt = None,
        dp_replicas: DpReplicasOpt = None,
        distributed_optimizer: DistOptOpt = False,
        recompute: RecomputeOpt = None,
        recompute_modules: RecomputeModulesOpt = None,
        first_stage_layers: FirstStageOpt = None,
        last_stage_layers: LastStageOpt = None,
        account_for_embedding: AccountEmbeddingOpt = False,
        account_for_loss: AccountLossOpt = False,
        pp_layout: PpLayoutOpt = None,
        fp8_recipe: Fp8RecipeOpt = None,
        fp8_param_gather: Fp8GatherOpt = False,
        ep: EpOpt = 1,
        etp: EtpOpt = 1,
        moe_imbalance: MoeImbalanceOpt = 1.0,
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
        model_option: ModelOptionOpt = None,
        inputs: InputsOpt = None,
        loss: LossOpt = None,
        warmup_steps: WarmupOpt = 1,
        steps: StepsOpt = 3,
        json_out: JsonOpt = False,
    ) -> None:
        """One SageMaker training job per candidate (existing jobs are skipped)."""
        flags = locals()
        from planner.aws import launch as awslaunch
        from planner.aws import session as awssession
        from planner.probes import store

        region_name = awssession.resolve_region(region, profile) if not dry_run else (
            region or awssession.first_env(awssession.REGION_ENV) or "us-east-1")
        role_arn = awssession.resolve_role(role, dry_run=dry_run)
        s3 = awssession.resolve_bucket(bucket, region=region_name, dry_run=dry_run)
        requests = build_requests(study, top, model, instance, _config_args(flags), model_option,
            warmup_steps, steps, inputs, loss)
        opts = awslaunch.LaunchOptions(role_arn=role_arn, s3=s3, region=region_name, spot=spot,
                                       max_run_minutes=max_run_minutes, max_wait_minutes=max_wait_minutes,
                                       volume_gb=volume_gb, image_uri=image, framework_version=framework_version)
        if dry_run:
            results = awslaunch.launch(requests, opts, dry_run=True, jobs_dir=_jobs_dir())
            payload = [{**store.redact(r.request), "RoleArn": store.redact_string(r.request["RoleArn"])}
                       for r in results]  # the role is shown with its account id masked
            typer.echo(dumps_json(payload if len(payload) > 1 else payload[0], indent=None if json_out else 2))
            return

        def saved(res: Any, req: Any) -> None:  # record each job as soon as it exists
            store.save_request(req.to_json())
            store.add_jobs({res.job_name: awslaunch.jobs_entry(res, req, region_name)})

        aws = awssession.Aws(region_name, profile)
        results = awslaunch.launch(requests, opts, aws=aws, jobs_dir=_jobs_dir(), on_result=saved)
        if json_out:
            typer.echo(dumps_json([{"job_name": r.job_name, "action": r.action, "status": r.status,
                                    "request_id": r.request_id, "image": store.redact_string(r.image)}
                                   for r in results]))
            return
        for r in results:
            console.print(f"{r.action:8} {r.job_name}  {r.status or ''}  {store.redact_string(r.image)}",
                          highlight=False)

    @probe.command("status")
    @handles_errors
    def status_cmd(study: StudyOpt = None, job: JobOpt = None, region: RegionOpt = None, profile: ProfileOpt = None,
                   json_out: JsonOpt = False) -> None:
        """DescribeTrainingJob for launched probe jobs."""
        from planner.aws.collect import describe
        from planner.cli.tables import Rows

        aws_for = _aws_factory(profile, region)
        rows = []
        for name, entry in _selected_jobs(study, job).items():
            info = describe(aws_for(entry.get("region")), name)
            rows.append({"job_name": name, "status": info.status if info else "NotFound",
                         "secondary_status": info.secondary_status if info else None,
                         "failure_reason": info.failure_reason if info else None,
                         "training_seconds": info.training_seconds if info else None,
                         "study": entry.get("study"), "trial": entry.get("trial")})
        if json_out:
            typer.echo(dumps_json(rows, default=str))
            return
        t = Rows(title="probe jobs")
        for col in ("job", "status", "secondary", "seconds", "failure reason"):
            t.add_column(col)
        for r in rows:
            t.add_row(r["job_name"], r["status"], str(r["secondary_status"] or ""), str(r["training_seconds"] or ""),
                      (r["failure_reason"] or "")[:120])
        t.print(console)

    @probe.command("collect")
    @handles_errors
    def collect_cmd(study: StudyOpt = None, job: JobOpt = None, region: RegionOpt = None, profile: ProfileOpt = None,
                    force: Annotated[bool, typer.Option("--force", help="Download finished jobs again.")] = False,
                    json_out: JsonOpt = False) -> None:
        """Download finished jobs' results into results/probes/ and results/probes.parquet."""
        from planner.aws.collect import collect_jobs
        from planner.probes import store

        aws_for = _aws_factory(profile, region)
        try:
            results = collect_jobs(aws_for, _selected_jobs(study, job), force=force)
        finally:
            if any(store.probes_dir().glob("*.json")):
                store.rebuild_parquet()  # whatever was collected before an error stays in the table
        if json_out:
            typer.echo(dumps_json([{"job_name": c.job_name, "action": c.action, "status": c.status,
                                    "job_status": c.job_status} for c in results]))
            return
        for c in results:
            console.print(f"{c.action:10} {c.job_name}  {c.job_status}  -> {c.status}", highlight=False)
        done = [c.record for c in results if c.record]
        if done:
            print_records(done)

    @app.command("validate")
    @handles_errors
    def validate_cmd(
        probes: ProbesOpt = None,
        readings: Annotated[list[Path] | None, typer.Option(
            "--readings", help="Folders of GPU readings (steps.jsonl, env.json) to compare instead of probe "
                               "results; default with no probe results: the shared H200 readings.")] = None,
        stored: Annotated[bool, typer.Option("--stored", help="Use the predictions stored with each probe.")] = False,
        csv: Annotated[Path | None, typer.Option("--csv", help="CSV path (default results/validation-report.csv).")]
        = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Predicted vs measured memory terms and speed, per probe run: signed % errors, fit/OOM agreement."""
        import pandas as pd

        from planner.io import atomic_path
        from planner.probes import store
        from planner.probes.validate import long_rows, summary, validate

        if readings or (probes is None and not store.load_records(None)):
            _validate_readings(readings, json_out)
            return
        records = store.load_records(probes)
        if not records:
            raise PlannerError("--probes", [str(p) for p in probes or [store.probes_dir()]],
                               "folders or files with probe results (run `planner probe run` or `collect`)")
        rows = validate(records, stored_only=stored)
        summ = summary(rows)
        csv_path = csv or store.results_dir() / "validation-report.csv"
        with atomic_path(csv_path, "--csv") as tmp:
            pd.DataFrame(long_rows(rows)).to_csv(tmp, index=False)
        if json_out:
            typer.echo(dumps_json({"rows": [r.to_json() for r in rows], "summary": summ, "csv": str(csv_path)},
                                  default=str))
            return
        print_validation(rows, summ)
        err_console.print(f"csv: {csv_path}")

    @app.command("calibrate")
    @handles_errors
    def calibrate_cmd(
        probes: ProbesOpt = None,
        out: Annotated[Path | None, typer.Option("--out", help="Default results/calibration.json.")] = None,
        dry_run: Annotated[bool, typer.Option("--dry-run", help="Fit and print; write nothing.")] = False,
        json_out: JsonOpt = False,
    ) -> None:
        """Fit CUDA context, fragmentation and a throughput scale per GPU family (medians of probe runs)."""
        from planner.io import write_json
        from planner.probes import calibrate as cal
        from planner.probes import store

        records = store.load_records(probes)
        estimates = {str(r.get("record_id")): default_estimate(r) for r in records
                     if r.get("status") == "ok" and r.get("device") == "cuda"}
        result = cal.calibrate(records, estimates)
        if not result["families"]:
            raise PlannerError("--probes", [str(p) for p in probes or [store.probes_dir()]],
                               "successful CUDA probe results (status ok, device cuda) of a known GPU")
        doc = cal.calibration_document(result, len(estimates))
        path = out or store.results_dir() / "calibration.json"
        if not dry_run:
            # strict JSON: the runtime loader refuses NaN, so it is never written (one line naming --out)
            write_json(path, cal.merge_into(path, doc), "--out", indent=1, default=str)
        if json_out:
            typer.echo(dumps_json({"calibration": doc, "report": result["report"], "path": str(path),
                                   "written": not dry_run}, default=str))
            return
        print_calibration(result["report"])
        err_console.print(("would write " if dry_run else "wrote ") + str(path))


def _validate_readings(folders: list[Path] | None, json_out: bool) -> None:
    """`planner validate --readings`: each reading against today's prediction, term by term."""
    from planner.probes import readings as rd
    from planner.probes.readings_check import check, summary

    folders = folders or [rd.SHARED]
    loaded = []
    for folder in folders:
        if not (folder / "steps.jsonl").exists():
            raise PlannerError("--readings", str(folder), "a folder holding steps.jsonl and env.json")
        loaded += rd.load_steps(folder)
    fit_rows, _ = rd.fit_split(rd.load_steps(rd.SHARED))
    rows = check(loaded, {(r.folder, r.index) for r in fit_rows})
    summ = summary(rows)
    if json_out:
        typer.echo(dumps_json({"rows": [r.to_json() for r in rows], "summary": summ}, default=str))
        return
    print_readings(rows, summ)


def print_readings(rows: list[Any], summ: dict[str, Any]) -> None:
    from planner.cli.tables import Rows

    gpus = ", ".join(sorted({f"{r.reading.gpu} as {r.reading.instance}" for r in rows}))
    t = Rows(title=f"GPU readings vs prediction ({gpus}, one GPU; signed %: + = over)")
    for col in ("step", "alloc", "resv", "device", "time", "ms", "bound"):
        t.add_column(col)
    for r in rows:
        e = r.errors
        mark = "*" if r.fitted else ""
        t.add_row(r.reading.label + mark, _pct(e["peak_allocated"]), _pct(e["peak_reserved"]),
                  _pct(e["device_peak"]), _pct(e["step_time_s"]), f"{r.reading.step_time_s * 1e3:.1f}", r.bound)
    t.print(console)
    s = Rows(title="summary (* = row in the speed fit; time = step time)")
    for col in ("term", "n", "median signed", "median |err|"):
        s.add_column(col)
    for k, v in summ.items():
        s.add_row(k.replace("step_time_s", "step time"), str(v["n"]), _pct(v["median_signed_pct"]),
                  _num(v["median_abs_pct"], "{:.1f}%"))
    s.print(console)


def default_estimate(record: dict[str, Any]) -> dict[str, Any] | None:
    """The record re-estimated with the documented runtime defaults (no calibration file), else stored."""
    try:
        import planner
        from planner.hardware import get_instance
        from planner.memory.runtime import runtime_constants
        from planner.spec import ModelSpec, TrainConfig

        inst = get_instance(record["instance"])
        est = planner.estimate(ModelSpec.model_validate(record["model_spec"]),
                               TrainConfig.model_validate(record["config"]), inst,
                               runtime=runtime_constants(inst.gpu, calibration={}))
        return est.to_json()
    except Exception:  # noqa: BLE001 - missing spec/instance or estimator not ready: use the stored one
        return record.get("estimate")


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:+.1f}%"


def print_validation(rows: list[Any], summ: dict[str, Any]) -> None:
    from planner.cli.tables import Rows
    from planner.probes.validate import TERMS, config_label

    short = {"parameters": "params", "gradients": "grads", "optimizer_states": "optim", "model_states": "states",
             "activations": "act", "peak_allocated": "peak alloc", "peak_reserved": "peak resv",
             "device_peak": "device", "samples_per_s": "samples/s"}
    t = Rows(title="predicted vs measured (signed error: + = over-estimate)")
    for col in ("model", "gpu", "config", "status", *(short[k] for k in TERMS), "fit", "pred."):
        t.add_column(col)
    for r in rows:
        fit = "-" if r.fit_agrees is None else ("agree" if r.fit_agrees else "DISAGREE")
        t.add_row(str(r.model), str(r.gpu_measured or r.device), config_label(r.config), r.status,
                  *(_pct(r.errors[k]) for k in TERMS), fit, r.prediction_source)
    t.print(console)
    s = Rows(title="summary per term")
    for col in ("term", "n", "median signed", "mean |err|", "max |err|"):
        s.add_column(col)
    for k in TERMS:
        v = summ[k]
        s.add_row(k, str(v["n"]), _pct(v["median_signed_pct"]), _num(v["mean_abs_pct"], "{:.1f}%"),
                  _num(v["max_abs_pct"], "{:.1f}%"))
    fa = summ["fit_agreement"]
    s.add_row("fit/OOM agreement", str(fa["n"]), "-", "-" if fa["rate"] is None else f"{fa['rate']:.0%} agree", "")
    s.print(console)


def print_calibration(report: dict[str, Any]) -> None:
    from planner.cli.tables import Rows

    t = Rows(title="calibration per GPU family (median |error| before -> after, leave-one-out)")
    for col in ("family", "runs", "cuda context", "fragmentation", "throughput scale", "reserved err",
                "device err", "samples/s err"):
        t.add_column(col)
    for fam, r in report.items():
        c = r["constants"]

        def trio(term: str, r: dict[str, Any] = r) -> str:
            b, a, loo = r["before"][term], r["after"][term], r["after_leave_one_out"][term]
            return f"{_num(b, '{:.1f}%')} -> {_num(a, '{:.1f}%')} (LOO {_num(loo, '{:.1f}%')})"

        t.add_row(fam, str(r["n"]), "-" if c["cuda_context_bytes"] is None else f"{c['cuda_context_bytes'] / 2**20:.0f} MiB",
                  _num(c["fragmentation"], "{:.3f}"), _num(c["throughput_scale"], "{:.3f}"), trio("peak_reserved"),
                  trio("device_peak"), trio("samples_per_s"))
    t.print(console)
