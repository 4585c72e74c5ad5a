"""Activation bytes per transformer layer: Korthikanti et al. 2022 against the planner, per rank.

Source: V. Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
arXiv:2205.05198, Table 2 (bytes per layer for each technique) and Table 3 (the 22B, 175B, 530B and 1T
GPT-3-style models), committed in results/public/korthikanti/ (planner.probes.korthikanti loads them).

For each model and each of Table 2's techniques at the model's tensor-parallel size t (t = 1 for "none"), the
script prints the paper's bytes, the planner's per-rank bytes of one layer (the layer it keeps after the
forward: what an estimate adds up), and the difference. The planner's layer is GPT-2's form (transformers
GPT2Block, the closest to Megatron's GPT layer) with the paper's sizes: GeLU (not GPT-2's Python gelu_new),
dropout 0.1 after attention and both projections, 16-bit weights and activations (precision fp16), eager
attention (the paper's layer materialises the softmax), CUDA, sequence parallelism saving the local shard as
Megatron-Core does. Nothing is fitted: the one expected difference is the LayerNorms' fp32 mean and rstd
(2 LayerNorms · 2 · 4 bytes per row on this rank), which the paper does not count, plus the caching
allocator's 512-byte rounding.

    python benchmarks/korthikanti.py            # every model, every technique
    python benchmarks/korthikanti.py 175B       # one model
"""

from __future__ import annotations

import sys

from planner.memory.activations import activation_blocks
from planner.models.hf_config import spec_from_hf_config
from planner.probes.korthikanti import PaperModel, load_formulas, load_models
from planner.spec import TrainConfig

MIB = 2**20


def gpt3_style(m: PaperModel):
    """A two-layer GPT-2-form model with the paper's sizes (per-layer figures do not depend on the depth)."""
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": m.hidden, "n_head": m.heads,
              "n_layer": 2, "n_inner": 4 * m.hidden, "n_positions": m.seq_len, "n_ctx": m.seq_len,
              "vocab_size": m.vocab, "activation_function": "gelu", "attn_pdrop": 0.1, "resid_pdrop": 0.1,
              "embd_pdrop": 0.1, "layer_norm_epsilon": 1e-5}
    return spec_from_hf_config(config, name=f"gpt3-style-{m.model}")


def planner_layer(m: PaperModel, t: int, sp: bool, selective: bool, full: bool) -> tuple[int, int]:
    """(the planner's bytes of one layer on one rank, the LayerNorm statistics among them)."""
    cfg = TrainConfig(batch_size=m.micro_batch, seq_len=m.seq_len, precision="fp16", attention="eager", tp=t,
                      sp=sp, checkpointing=full, recompute="selective" if selective else None,
                      recompute_modules=("core_attn",) if selective else ())
    # block 0 is the embeddings; layer 1 (not 0: the first checkpointed layer also keeps the shared mask)
    layer = activation_blocks(gpt3_style(m), cfg, "cuda", padded=False)[2]
    stats = sum(x.nbytes for x in layer.kept_tensors if x.name.endswith((".mean", ".rstd")))
    return layer.kept_bytes, stats


def main(argv: list[str]) -> int:
    formulas = load_formulas()
    models = [m for m in load_models() if not argv or m.model in argv]
    print("Activation bytes per transformer layer on one rank (MiB): Korthikanti et al. 2022 (arXiv:2205.05198)")
    print("Table 2 formulas, Table 3 models; planner: GPT-2 form with GeLU, fp16, eager attention, CUDA.")
    print(f"{'model':<6}{'technique':<17}{'t':>3}{'paper':>11}{'planner':>11}{'diff':>9}{'diff %':>8}"
          f"{'LN stats':>10}")
    worst = 0.0
    for m in models:
        s, b, h, a = m.seq_len, m.micro_batch, m.hidden, m.heads
        for name, f in formulas.items():
            t = m.tp if f.tp else 1
            paper = f.bytes(s, b, h, a, t)
            ours, stats = planner_layer(m, t, f.sp, f.selective, f.full)
            diff = ours - paper
            rest = (diff - stats) / paper  # what the stated difference does not explain
            worst = max(worst, abs(rest))
            print(f"{m.model:<6}{name:<17}{t:>3}{paper / MIB:>11.1f}{ours / MIB:>11.1f}{diff / MIB:>9.2f}"
                  f"{100 * diff / paper:>8.3f}{stats / MIB:>10.2f}")
    print(f"largest difference left after the LayerNorm statistics: {100 * worst:.4f} % of the paper's bytes "
          "(the allocator's 512-byte rounding)")
    if not argv:
        llama_against_formula(formulas)
    return 0


def llama_against_formula(formulas) -> None:
    """Where the planner's own models differ from the formula: Llama-3-8B (transformers LlamaDecoderLayer) in
    bf16 with FlashAttention-2 at 4096 tokens, per layer on one rank. Flash saves no s² tensor (the 5as/h
    term is not there to remove), there is no dropout, HF's RMSNorm saves an fp32 copy of its input and the
    normalised tensor, and SwiGLU saves four ffn-wide tensors (ffn = 3.5 h)."""
    from planner.models.catalog import cached_model

    m = cached_model("llama-3-8b")
    t0 = m.transformers[0]
    s, b, h, a = 4096, 1, t0.hidden_size, t0.num_heads
    print()
    print("The planner's Llama-3-8B layer (bf16, FlashAttention-2, s=4096, b=1) against the same formula (MiB):")
    print(f"{'technique':<28}{'t':>3}{'paper':>9}{'planner':>9}")
    for tech, tp, sp, mods in (("none", 1, None, ()), ("tp", 8, False, ()), ("tp+sp", 8, True, ()),
                               ("tp+sp+selective", 8, True, ("core_attn",)), ("tp+sp+selective", 8, True, ("op",)),
                               ("full", 1, None, ())):
        cfg = TrainConfig(batch_size=b, seq_len=s, precision="bf16", attention="flash", tp=tp, sp=sp,
                          checkpointing=tech == "full", recompute="selective" if mods else None,
                          recompute_modules=mods)
        layer = activation_blocks(m, cfg, "cuda", padded=False)[2]
        label = f"{tech} ({mods[0]})" if mods else tech
        print(f"{label:<28}{tp:>3}{formulas[tech].bytes(s, b, h, a, tp) / MIB:>9.0f}{layer.kept_bytes / MIB:>9.0f}")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
