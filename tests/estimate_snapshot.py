"""The estimate snapshot: a grid of configurations and the figures of each, written by the code as it was
before the one-program refactor (issue 33), so the refactored code can be compared with it.

This is a regression guard, not a truth: the figures are the planner's own output at the commit that wrote
the fixture, and `tests/test_estimate_snapshot.py` checks that a refactor leaves them unchanged. Where the
refactor corrects a disagreement between two old copies of a layer (checked against a real module on CPU),
the fixture is regenerated in the same commit and the commit message and ARCHITECTURE.md say which figure
moved and why.

Deliberate changes since the pre-refactor fixture (each regenerated the fixture in its own commit):
1. Parameter tensors for speed come from the program (`perf.throughput.parameter_counts`): GPT-2 148 tensors,
   not 198; masked-LM heads 5, causal-LM heads 1 (0 tied), classifier heads as built; the module's
   `named_parameters()` confirms the program (tests/test_program.py). Only ZeRO-3 step times move (its
   per-unit NCCL calls follow the tensor count): 104 of 347 estimates, communication time only, step time
   by at most 3.5 %; memory unchanged everywhere.
2. The speed kernel list is the program's (`perf.kernels.block_kernels` reads the layer forms' ops; its own
   layer, embeddings and head lists are deleted). Where the two lists disagreed the module decides
   (tests/test_program.py counts the ATen ops of real modules): RoBERTa looks up token types even without
   them in the batch, RoBERTa's and DistilBERT's classifiers run dropout, DistilBERT's layer has no dropout
   after out_lin, GPT-2's c_proj casts gelu_new's fp32 output under AMP. 150 of 347 estimates move, all of
   RoBERTa / DistilRoBERTa / DistilBERT and GPT-2 under AMP (LoRA and QLoRA included), step time by at most
   3.7 % (GPT-2 AMP: the added cast); BERT, Llama, Mistral and the multimodal model unchanged; memory
   unchanged everywhere.
3. QLoRA without checkpointing (issue 36; the three `|qlora` cases, AMP bf16, no checkpointing): peft's
   `prepare_model_for_kbit_training` makes the embeddings' output require grad only under checkpointing, so
   without it the embedding output is not saved (GPT-2, RoBERTa: -4 MB of activations); bitsandbytes' 4-bit
   layers return their input's dtype, so under AMP the gated MLP's gate, up and SiLU outputs are saved in
   fp32 (Llama-3-8B: +2.6 GiB). Both checked on a tiny model with real NF4 layers and peft on CPU
   (tests/test_lora_loading.py) and on the held-out H200 QLoRA reading without checkpointing (allocated
   -19.8 % -> -0.2 %). Memory only; no other case moves.
4. (Outside the grid, which has no DataParallel: the fixture is unchanged.) nn.DataParallel's GPU-0 extra is
   one function for both front ends (`memory.parallel.dataparallel_gpu0_extra_bytes`); the analytic copy
   said the gathered logits were fp32 and a classifier's 8 bytes per sample, the traced one 16-bit under
   autocast and num_labels wide. The module decides: transformers' GPT2LMHeadModel and
   BertForSequenceClassification under CPU autocast (bf16) return bfloat16 logits of num_labels
   (tests/test_dataparallel_gpu0.py compares both front ends). Only `--parallelism dp` moves: its GPU-0
   memory and its scatter/gather speed term (GPT-2 tiny, amp-bf16, 8 GPUs: 8,235,008 -> 4,139,008 B).
5. ZeRO-3/FSDP's per-unit collectives hide unit by unit (issue 32): every unit's collective but the first
   of a phase hides behind the compute it is prefetched beside, up to that compute (`shard_overlap` 0.5 ->
   1.0: the old value exposed half of every collective however long the compute), and the hidden seconds
   slow compute by NCCL's channels / SMs (planner.perf.collectives.overlap_contention_s). The 112 zero3
   estimates move, communication time only: step time -23 % to +2 % (+ where the compute was already the
   bound and contention now adds); memory unchanged everywhere.
6. LoRA and QLoRA read the program (issue 33: `planner.ir.transforms.lora_layers`, adapter ops added and
   frozen parameters' saved inputs dropped; the memory model sums the transformed program's ops, where
   planner.adapters.activations had regrouped the full-training records by tensor names). Over 5,824
   LoRA configurations (14 catalog models and their classifier heads × precisions × targets × dropout × base
   dtypes × both backends × eager/SDPA) every block's saved and kept bytes equal the old records' except
   where the old ones disagreed with the module, three cases:
   a. a QLoRA masked-LM head (BERT, RoBERTa, DistilBERT, DistilRoBERTa): the old records dropped every AMP
      weight cast of a block holding a 4-bit Linear, but the tied decoder is not quantized, and its matmul
      saves the 16-bit cast of its fp32 weight (a tiny RobertaForMaskedLM with bitsandbytes NF4 layers,
      prepare_model_for_kbit_training and peft on the CPU under bf16 autocast saves one bf16 (h, V) tensor):
      the program casts per Linear. In the grid: roberta-base|qlora, +77.2 MB of activations (50265 × 768
      × 2 B); the program's side.
   b. the saved tensors' order inside a block (what the allocator replay lays out): the old records put
      every adapter's tensors at the block's end; the program keeps forward order, and each adapter's weight
      cast before its input, which is the order saved-tensor hooks see on real peft modules
      (tests/test_lora_program.py). Reserved peaks move by 4-8 MiB in gpt2|lora, gpt2|qlora,
      llama-3-8b|qlora; allocated bytes unchanged.
   c. (outside the grid) an adapter on a Linear reading b rows (the pooler, a classifier's pre_classifier):
      lora_B saves b·r elements, not n·r; the multimodal model's text modules are named
      `TextBertBase.0.encoder...` as `named_modules()` names them (the old names lacked the nn.Sequential
      index, so the transform found no adapter there; the old records matched them by suffix).
   No step time moves: the adapters' and dequantizations' kernels, read from the same transformed program
   since (planner.adapters.speed.program_kernels), equal the old per-module list in every LoRA case.
7. Step-time kernels as CUDA runs them (issue 36; memory unchanged everywhere):
   a. the eager attention's elementwise passes (scale, mask add, softmax, dropout, probability cast, copies)
      are of kind "attention" for the breakdown, and their backward took the fused SDPA kernel's rule (reads
      + 2 × writes: about twice their bytes); now the elementwise rule (`perf.kernels.is_fused_attention`),
      and the additive mask is read once per sample (b·s·kv_s), not once per head;
   b. the universal efficiencies refitted on the same public rows after (a) (benchmarks/fit_roofline.py:
      GEMM 0.625 -> 0.60, HBM 0.90 -> 0.775; Hopper's own row is unchanged: benchmarks/fit_gemm_size.py
      refits F_1/2 = 15 GFLOP and HBM 0.50 again): every non-Hopper estimate's step time moves;
   c. LoRA / QLoRA under checkpointing recompute the adapters' forward and each 4-bit dequantization
      (`adapters.speed.program_kernels`); a double-quantized 4-bit dequantization is three launches and a 4-bit
      Linear fed fp32 casts its output back to fp32 (bitsandbytes 0.50.2 source lines in that module);
   d. a traced model's CPU dropout (bernoulli_, div_, mul) is timed as CUDA's one fused dropout kernel
      (`program.speed.cuda_rows`).
8. The reserved pool's band around the allocator replay (issue 32, planner.memory.band): the margin is the
   largest miss of the replay over the H200 step readings (the H100 ones held out, all inside), -12 % / +15 %
   of allocated (was an assumed -3 % / +8 %), and the high end stays at least the flat 1.3 x allocated where no reading checks the replay (torch
   not named, torch 1.x, more than one GPU, an allocator option no reading has). Only the band moves:
   peak_device_low_bytes in 256 estimates, peak_device_high_bytes in 155; one verdict,
   llama-3-8b fp32 zero3 on 8 A100s, fits -> tight (its replayed pool is 21 % of allocated, + 15 % passes the
   flat 30 %); no point figure moves.
9. Cross-entropy on 16-bit logits under CUDA autocast is ATen's composite (issue 36,
   `activations.cross_entropy_saved`): log_softmax keeps the logits' dtype and nll_loss saves autocast's fp32
   copy of its output (6 bytes a logit, not 4), with no unsaved fp32 copy in forward and one fp32 gradient
   at the backward peak (not two). The shared H200 readings decide: BERT-base MLM's saved bytes now within
   0.4 MiB of the measured (1 GB short before at b32 x 512) and its peak allocated within -0.3 % (+6.7 %).
   The masked-LM models under amp-bf16 move (and roberta-base's LoRA/QLoRA cases, the BERT run): 88 of 347
   estimates, memory only, peak allocated 0 to -10.6 %; no verdict, no step time.
10. GPT-2's Python gelu_new as autograd runs it (issue 36, `perf.kernels.python_gelu`): under autocast `pow`
   casts x to fp32 in its own copy kernel, and the backward is autograd's formulas (both products of the last
   mul, 16-bit gradients cast back, pow's three kernels, the sum of x's three gradients), not one generic
   pass per forward op: +26 bytes an element per layer under amp-bf16 (70 + 112, was 62 + 94; fp32's total is
   unchanged, its launches +3). The GPT-2 family moves, step time only (memory unchanged): 99 of 347
   estimates, +0.01 % to +7.6 %. (Hopper's refit with the mixed-dtype passes' rate, ARCH_DYNAMIC_CAST, moves
   no estimate here: the grid has no Hopper instance.)
11. A traced model's bool attention mask becomes SDPA's additive bias as one `where` into the query's dtype
   (`program.trace.additive_mask`, what torch dispatches for attention.cpp's convert_boolean_attn_mask; the
   tracer had a logical_not, a `where` into fp32 and a cast). Only the traced BART case moves: step time
   -1.1 %, memory unchanged.
12. Checkpointing under autocast casts each layer's weights to 16 bits again in the recomputation (its
   autocast region starts with an empty cast cache: torch/utils/checkpoint.py, autocast_mode.py's __exit__),
   timed as recompute kernels (`perf.kernels.block_kernels`). 87 estimates move (every amp-bf16 case with
   checkpointing, and the three LoRA ones), step time only: +0.1 % (Llama on 4 A10G) to +10.3 % (RoBERTa LoRA;
   the small models under ZeRO-3 on 8 A100s +9-10 %, their recompute launch-bound).
13. A traced model's reserved peak replays its step twice, the first step (optimizer states made inside it,
   after backward freed the activations) then the steady one, with the loop's lifetimes
   (`program.replay.run_events`; it replayed the steady step alone with the states first). Two real training
   steps recorded op by op reserve exactly what the replay does (tests/test_traced_two_steps.py); on the
   held-out traced H200 readings reserved median |error| 1.8 % -> 0.4 %. The traced BART case moves:
   peak_reserved +6.0 % (3,152,019,456 -> 3,340,763,136 B). With it the reserved band's low margin, the
   largest miss of the readings, is -10 % of allocated (was -12 %, set by BART-base traced): every estimate's
   peak_device_low_bytes rises a little; no verdict, no other point figure, no step time moves.

Regenerate (from the repository root, ~1-2 minutes on 2 cores):

    python tests/estimate_snapshot.py            # writes tests/data/estimate_snapshot.json

The grid: every catalog model × {fp32, amp-bf16} × checkpointing {off, on} × {single, ddp, zero3} × two
instance types (4× A10G, 8× A100), plus LoRA, QLoRA, a run of varying lengths and a traced config.json.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import Any

FIXTURE = Path(__file__).resolve().parent / "data" / "estimate_snapshot.json"
TRACED_CONFIG = Path(__file__).resolve().parent / "data" / "bart-base.json"

PRECISIONS = ("fp32", "amp-bf16")
CHECKPOINTING = (False, True)
PARALLELISMS = ("single", "ddp", "zero3")
INSTANCES = ("ml.g5.12xlarge", "ml.p4d.24xlarge")
BATCH, SEQ = 4, 256


def grid_cases() -> list[tuple[str, str, dict[str, Any], str, dict[str, Any]]]:
    """(key, model, TrainConfig fields, instance, extra estimate() keywords) of the torch-free grid."""
    from planner.models.catalog import cached_model, list_models

    # the mixture-of-experts models came after the fixture (issue 35): tests/test_moe.py checks them
    dense = [m for m in list_models() if not any(t.moe for t in cached_model(m).transformers)]
    out = []
    for model, prec, ckpt, par, inst in itertools.product(dense, PRECISIONS, CHECKPOINTING, PARALLELISMS,
                                                          INSTANCES):
        cfg = {"batch_size": BATCH, "seq_len": SEQ, "precision": prec, "checkpointing": ckpt, "parallelism": par}
        out.append((f"{model}|{prec}|ckpt={ckpt}|{par}|{inst}", model, cfg, inst, {}))
    lora = {"batch_size": BATCH, "seq_len": SEQ, "precision": "amp-bf16", "parallelism": "single", "lora_r": 16}
    for model in ("llama-3-8b", "gpt2", "roberta-base"):
        out.append((f"{model}|lora", model, lora, "ml.g5.12xlarge", {}))
        out.append((f"{model}|qlora", model, lora | {"base_dtype": "nf4"}, "ml.g5.12xlarge", {}))
        out.append((f"{model}|lora-ckpt", model, lora | {"checkpointing": True}, "ml.p4d.24xlarge", {}))
    run = {"batch_size": 8, "seq_len": 512, "precision": "amp-bf16", "parallelism": "single"}
    out.append(("bert-base-uncased|run", "bert-base-uncased", run, "ml.p4d.24xlarge",
                {"run": ("uniform:64-512:8", 40)}))
    return out


def traced_cases() -> list[tuple[str, str, dict[str, Any], str, dict[str, Any]]]:
    """The traced front end (needs torch: the tracer runs the module under FakeTensorMode)."""
    cfg = {"batch_size": 2, "seq_len": 128, "precision": "amp-bf16", "parallelism": "single"}
    return [("bart-base.json|traced", str(TRACED_CONFIG), cfg, "ml.g5.12xlarge", {})]


def figures(model: str, cfg: dict[str, Any], instance: str, extra: dict[str, Any]) -> dict[str, Any]:
    """The figures the refactor must keep: memory by term and phase, verdict, band, parameters, speed."""
    from planner.estimate import estimate
    from planner.run import simulate
    from planner.spec import TrainConfig

    kw = dict(extra)
    if "run" in kw:
        lengths, steps = kw.pop("run")
        kw["run"] = simulate.request(lengths, steps=steps, seed=0)
    est = estimate(model, TrainConfig(**cfg), instance, **kw)
    j = est.to_json()
    out: dict[str, Any] = {
        "world_size": j["world_size"], "parameters": j["parameters"], "memory_bytes": j["memory_bytes"],
        "phases": [[p["phase"], p["allocated"], p["detail"]] for p in j["phases"]], "verdict": j["verdict"],
        "peak_device_low_bytes": j["peak_device_low_bytes"], "peak_device_high_bytes": j["peak_device_high_bytes"],
    }
    thr = j["throughput"]
    if thr is not None:
        out["throughput"] = {"step_time_s": thr["step_time_s"], "breakdown_s": thr["breakdown_s"]}
    if j.get("run"):
        r = j["run"]
        out["run"] = {k: r[k] for k in ("peak_reserved_bytes", "growth_bytes", "peak_step", "longest")}
    return out


def snapshot(cases) -> dict[str, dict[str, Any]]:
    return {key: figures(model, cfg, inst, extra) for key, model, cfg, inst, extra in cases}


def main() -> None:
    data = snapshot(grid_cases() + traced_cases())
    FIXTURE.write_text(json.dumps(data, indent=0, sort_keys=True) + "\n")
    print(f"wrote {len(data)} estimates to {FIXTURE}", file=sys.stderr)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
