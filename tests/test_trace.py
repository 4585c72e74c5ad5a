"""The tracer (`planner.program.trace`) against real PyTorch: user-style modules on real CPU tensors, and the
analytic core on the catalog's own modules."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from planner.program.trace import trace_step
from planner.spec import TrainConfig
from tests.catalog_user import catalog_user_file

# ------------------------------------------------------------------------------- user-style modules


class ConvNet(nn.Module):
    """Convolutions, BatchNorm, a residual connection, pooling, a linear head."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8))
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        h = self.stem(x)
        h = torch.relu(h + self.block(h))
        return self.head(self.drop(h.mean(dim=(2, 3))))


class Attention(nn.Module):
    """Custom attention written with nn.Linear and softmax."""

    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        probs = self.drop(torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1))
        return x + self.out((probs @ v).transpose(1, 2).reshape(b, s, d))


class TinyLM(nn.Module):
    """Embedding tied to the output projection (weight sharing), attention layers with residuals, GELU MLP."""

    def __init__(self, vocab: int = 50, dim: int = 32, heads: int = 4, layers: int = 2, dropout: float = 0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Attention(dim, heads, dropout) for _ in range(layers))
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(dropout), nn.Linear(4 * dim, dim))
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, input_ids, labels):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        h = h + self.mlp(h)
        logits = self.lm_head(h)
        return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()), "logits": logits}


def conv_batch(b: int, s: int):
    return (torch.randn(b, 3, s, s),)


def lm_batch(b: int, s: int):
    return {"input_ids": torch.randint(0, 50, (b, s)), "labels": torch.randint(0, 50, (b, s))}


def _key(t: torch.Tensor) -> int:
    return StorageWeakRef(t.untyped_storage()).cdata


def real_saved_bytes(module: nn.Module, batch, loss_of) -> int:
    """What autograd saves on real CPU tensors: each storage once, without parameters, buffers, inputs."""
    leaves = batch.values() if isinstance(batch, dict) else batch
    excluded = {_key(p) for p in module.parameters()} | {_key(b) for b in module.buffers()}
    excluded |= {_key(t) for t in leaves}
    seen: dict[int, int] = {}

    def pack(t):
        k = _key(t)
        if k not in excluded:
            seen.setdefault(k, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of(module, batch)
    loss.backward()
    return sum(seen.values())


def _conv_loss(module, batch):
    return module(*batch).sum()


def _lm_loss(module, batch):
    return module(**batch)["loss"]


CASES = [
    ("conv, no dropout", lambda: ConvNet(0.0), conv_batch, _conv_loss, (4, 8)),
    ("conv, dropout", lambda: ConvNet(0.3), conv_batch, _conv_loss, (4, 8)),
    ("attention + tied weights, dropout", lambda: TinyLM(dropout=0.1), lm_batch, _lm_loss, (3, 7)),
    ("attention + tied weights, no dropout", lambda: TinyLM(dropout=0.0), lm_batch, _lm_loss, (3, 7)),
]


@pytest.mark.parametrize(("label", "build", "make", "loss_of", "shape"), CASES, ids=[c[0] for c in CASES])
def test_traced_saved_bytes_equal_real_cpu_hooks(label, build, make, loss_of, shape):
    b, s = shape
    torch.manual_seed(0)
    real_module = build().train()
    expected = real_saved_bytes(real_module, make(b, s), loss_of)
    trace = trace_step(build, make, TrainConfig(batch_size=b, seq_len=s), backend="cpu")
    assert trace.saved_bytes == expected
    assert trace.parameters["total"] == sum(p.numel() for p in real_module.parameters())


def test_shared_weights_counted_once_per_component():
    trace = trace_step(TinyLM, lm_batch, TrainConfig(batch_size=2, seq_len=5), backend="cpu")
    real = TinyLM()
    assert trace.parameters["embed"] == real.embed.weight.numel()
    assert "lm_head" not in trace.parameters  # its only weight is the embedding's
    assert trace.parameters["total"] == sum(p.numel() for p in real.parameters())
    assert len(trace.gradient_shapes) == len(list(real.parameters()))


def test_cuda_maps_dropout_noise_to_one_byte_masks():
    """CPU dropout saves a noise tensor of x's dtype; CUDA's native_dropout a bool mask (cuda.dropout_mask)."""
    cfg = TrainConfig(batch_size=4, seq_len=8)
    cpu = trace_step(lambda: ConvNet(0.3), conv_batch, cfg, backend="cpu")
    gpu = trace_step(lambda: ConvNet(0.3), conv_batch, cfg, backend="cuda")
    masks = [s for s in gpu.saved if s.rule == "dropout_saved"]
    assert [(s.dtype, s.shape) for s in masks] == [("bool", (4, 8))]
    assert {s.storage for s in cpu.saved if s.dtype == "float32"} >= {masks[0].storage}


def test_trace_records_ops_and_balanced_storage_events():
    trace = trace_step(TinyLM, lm_batch, TrainConfig(batch_size=2, seq_len=5), backend="cuda")
    phases = [o.phase for o in trace.ops]
    assert phases.index("backward") > phases.index("forward") and "optimizer" in phases
    assert any(o.name == "aten.mm.default" for o in trace.ops)
    allocs = {e.storage for e in trace.events if e.action == "alloc"}
    frees = {e.storage for e in trace.events if e.action == "free"}
    assert frees <= allocs
    saved = {s.storage for s in trace.saved}
    assert saved <= frees  # backward frees everything it saved
    assert {e.category for e in trace.events} >= {"parameter", "batch", "activation", "gradient", "optimizer_state"}


# ----------------------------------------------------------------- agreement with the analytic core


def _user_file(tmp_path, spec) -> str:
    """The catalog model as user code: jobs.modeling builds exactly the module the analytic core describes."""
    return catalog_user_file(tmp_path, spec, "catalog_model.py")


PEAK_TOLERANCE = 0.01  # issue 12: "peak allocated within 1 %" (these rows: worst 0.63 %, llama eager fp32)
AGREEMENT = [  # family, head, attention, checkpointing, precision, instance (V100: no flash; A100: flash)
    ("bert", "sequence-classification", "sdpa", False, "fp32", "ml.p3.2xlarge"),
    ("bert", "sequence-classification", "eager", True, "amp-fp16", "ml.p3.2xlarge"),
    ("bert", "sequence-classification", "sdpa", False, "amp-bf16", "ml.p4d.24xlarge"),
    ("gpt2", "causal-lm", "sdpa", False, "bf16", "ml.p4d.24xlarge"),
    ("gpt2", "causal-lm", "eager", False, "amp-bf16", "ml.p4d.24xlarge"),
    ("llama", "causal-lm", "sdpa", True, "amp-bf16", "ml.p4d.24xlarge"),
    ("llama", "causal-lm", "eager", False, "fp32", "ml.p3.2xlarge"),
    ("roberta", "sequence-classification", "eager", False, "fp32", "ml.p3.2xlarge"),
    ("distilbert", "sequence-classification", "sdpa", True, "amp-bf16", "ml.p4d.24xlarge"),
    ("multimodal", None, "sdpa", False, "amp-fp16", "ml.p3.2xlarge"),
    ("multimodal", None, "sdpa", True, "amp-fp16", "ml.p3.2xlarge"),
    ("multimodal", None, "eager", False, "bf16", "ml.p4d.24xlarge"),
]


@pytest.mark.parametrize(("family", "head", "attention", "ckpt", "precision", "instance"), AGREEMENT)
def test_traced_catalog_model_agrees_with_analytic(tmp_path, family, head, attention, ckpt, precision, instance):
    from planner.estimate import estimate
    from tests import saved_tensors as st

    spec = st.multimodal("bert") if family == "multimodal" else st.model(family, head)
    path = _user_file(tmp_path, spec)
    cfg = TrainConfig(batch_size=4, seq_len=64, attention=attention, checkpointing=ckpt, parallelism="single",
                      precision=precision)
    traced = estimate(f"{path}:build", cfg, instance, inputs=f"{path}:batch",
                      model_options={"attention": attention}, with_throughput=False)
    analytic = estimate(spec, cfg, instance, with_throughput=False)
    assert traced.parameters["total"] == analytic.parameters["total"]
    t, a = traced.memory_bytes.activations, analytic.memory_bytes.activations
    assert abs(t - a) <= 0.01 * a, (t, a)
    # Peak: layers' and the loss's backward temporaries are op by op on both sides
    # (tests/test_backward_transients.py); forward temporaries are still estimated by the analytic core.
    t, a = traced.memory_bytes.peak_allocated, analytic.memory_bytes.peak_allocated
    assert abs(t - a) <= PEAK_TOLERANCE * a, (t, a)


# ------------------------------------------------------------------- any transformers config.json


def _tiny_configs() -> dict[str, dict]:
    from transformers import BartConfig, Qwen2Config, T5Config, ViTConfig, WhisperConfig

    t5 = T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, vocab_size=64, decoder_start_token_id=0)
    vit = ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=16,
                    patch_size=8, num_labels=3)
    whisper = WhisperConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=64,
                            max_source_positions=16, num_mel_bins=8, pad_token_id=1, bos_token_id=2,
                            eos_token_id=2, decoder_start_token_id=2, max_target_positions=16)
    bart = BartConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                      decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=64,
                      max_position_embeddings=32)
    qwen2 = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    out = {}
    for cfg, arch in ((t5, "T5ForConditionalGeneration"), (vit, "ViTForImageClassification"),
                      (whisper, "WhisperForConditionalGeneration"), (bart, "BartForConditionalGeneration"),
                      (qwen2, "Qwen2ForCausalLM")):
        d = cfg.to_dict()
        d["architectures"] = [arch]
        out[arch] = d
    return out


@pytest.mark.parametrize("arch", ["T5ForConditionalGeneration", "ViTForImageClassification",
                                  "WhisperForConditionalGeneration", "BartForConditionalGeneration",
                                  "Qwen2ForCausalLM"])
def test_hf_config_outside_the_families_traces_like_the_real_module(arch):
    """Saved bytes (CPU kernels) equal saved_tensors_hooks on the real module; parameters exact, tied once."""
    from planner.program import hf

    config = hf.hf_config_object(_tiny_configs()[arch], "config.json", "eager")
    make = hf.batch_maker(config, "config.json")
    torch.manual_seed(0)
    real = hf.model_class(config)(config).train()
    expected = real_saved_bytes(real, make(2, 6), lambda m, b: m(**b).loss)
    trace = trace_step(hf.builder(config, "config.json"), make, TrainConfig(batch_size=2, seq_len=6), backend="cpu")
    assert trace.parameters["total"] == sum(p.numel() for p in real.parameters())
    assert trace.saved_bytes == expected


def test_traced_events_replay_through_the_allocator_permanent_storages_first():
    """Parameters, buffers, DDP buckets and the cuBLAS workspace come before the steps; the optimizer states
    are made inside the first step (after its backward), once (planner.program.replay.run_events)."""
    from planner.memory import allocator
    from planner.program.replay import replay_trace, run_events

    trace = trace_step(TinyLM, lm_batch, TrainConfig(batch_size=2, seq_len=5), backend="cuda")
    evs, names = run_events(trace, bucket_sizes=(1000,), workspace_bytes=4096)
    allocated: set[int] = set()
    seen_step = False
    for tid, nbytes in evs:
        if nbytes:
            assert tid not in allocated
            allocated.add(tid)
            if names[tid] not in ("parameter", "buffer", "ddp_bucket", "cublas_workspace"):
                seen_step = True
            else:
                assert not seen_step, "permanent storages come first"
            if names[tid] == "optimizer_state":
                assert seen_step, "the states are made inside the first step"
        else:
            assert tid in allocated
            allocated.discard(tid)
    permanent = sum(allocator.round_size(n) for t, n in evs if n
                    and names[t] in ("parameter", "buffer", "optimizer_state"))
    r = replay_trace(trace, ddp_bucket_bytes=1000, workspace_bytes=4096)
    assert r.peak_allocated >= permanent and r.peak_reserved >= r.peak_allocated


# ------------------------------------------------------------------------------ the traced kernel list


def test_traced_flops_equal_flop_counter_mode_on_the_real_module():
    """Forward + backward FLOPs recorded per op equal torch.utils.flop_counter.FlopCounterMode on real tensors."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    real = TinyLM(dropout=0.1).train()
    with FlopCounterMode(display=False) as counter:
        _lm_loss(real, lm_batch(3, 7)).backward()
    conv = ConvNet(0.2).train()
    with FlopCounterMode(display=False) as conv_counter:
        _conv_loss(conv, conv_batch(2, 8)).backward()
    for build, make, shape, expected in ((TinyLM, lm_batch, (3, 7), counter.get_total_flops()),
                                         (lambda: ConvNet(0.2), conv_batch, (2, 8), conv_counter.get_total_flops())):
        trace = trace_step(build, make, TrainConfig(batch_size=shape[0], seq_len=shape[1]), backend="cpu")
        assert sum(o.flops for o in trace.ops if o.phase in ("forward", "backward")) == expected > 0


def test_traced_throughput_agrees_with_the_analytic_kernel_list(tmp_path):
    """Two independent kernel lists of the same BERT: the traced one (its ATen ops) and the hand-written one
    (planner.perf.kernels) give the same GEMM time; the whole step within 10 % (the CPU trace runs dropout
    as bernoulli_/div_/mul where CUDA runs one native_dropout kernel)."""
    from planner.estimate import estimate
    from tests import saved_tensors as st

    spec = st.model("bert", "sequence-classification", full=True)
    path = _user_file(tmp_path, spec)
    cfg = TrainConfig(batch_size=8, seq_len=128, parallelism="single", precision="amp-fp16")
    traced = estimate(f"{path}:build", cfg, "ml.p3.2xlarge", inputs=f"{path}:batch")
    analytic = estimate(spec, cfg, "ml.p3.2xlarge")
    t, a = traced.throughput, analytic.throughput
    assert t is not None and a is not None
    assert t.breakdown_s["gemm"] == pytest.approx(a.breakdown_s["gemm"], rel=0.01)
    assert t.samples_per_s == pytest.approx(a.samples_per_s, rel=0.10)


@pytest.mark.parametrize(("build", "make", "seq", "precision"), [
    (TinyLM, lm_batch, 7, "fp32"), (lambda: TinyLM(dropout=0.0), lm_batch, 5, "amp-bf16"),
    (lambda: ConvNet(0.2), conv_batch, 8, "fp32")])
@pytest.mark.parametrize("b", [3, 8])
def test_trace_interpolated_between_two_batches_equals_the_direct_trace(build, make, seq, precision, b):
    """planner.program.scale: the step at micro-batch b from traces at 2 and 4 equals tracing b itself (ops with
    shapes and FLOPs, storage events, saved tensors, per-block saved bytes and measured transients)."""
    from planner.program.scale import scaled

    def at(n):
        return trace_step(build, make, TrainConfig(batch_size=n, seq_len=seq, precision=precision), backend="cuda")

    direct, interpolated = at(b), scaled(at(2), at(4), 2, 4, b)
    assert interpolated is not None
    assert interpolated.ops == direct.ops
    assert interpolated.events == direct.events
    assert interpolated.saved == direct.saved and interpolated.saved_bytes == direct.saved_bytes
    assert interpolated.blocks == direct.blocks
    assert interpolated.batch_bytes == direct.batch_bytes


def test_interpolation_refuses_two_different_programs():
    from planner.program.scale import scaled

    cfg = TrainConfig(batch_size=2, seq_len=5)
    assert scaled(trace_step(TinyLM, lm_batch, cfg), trace_step(lambda: TinyLM(layers=3), lm_batch,
                                                                cfg.model_copy(update={"batch_size": 4})),
                  2, 4, 8) is None
