"""The model option fake_balanced_gate=true: NeMo AutoModel's FakeBalancedGate (its benchmark recipes' router)
holds no weight and saves nothing, so the planner counts no router parameters, GEMM or saved input."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from planner import estimate
from planner.cli.main import app
from planner.models.catalog import get_model
from planner.models.params import count_parameters
from planner.spec import TrainConfig


class _FakeBalancedGate(torch.nn.Module):
    """nemo_automodel/components/moe/layers.py FakeBalancedGate (@cb976544), its noise-free forward as
    written there: `weights = torch.ones(n_tokens, a_exp, device=x.device) / a_exp`; `indices = (torch.arange(
    n_tokens * a_exp, device=x.device).view(-1, a_exp) % available_experts)`; `return weights.type_as(x),
    indices, None`. Its __init__ registers no parameter or buffer."""

    def __init__(self, n_experts: int, k: int):
        super().__init__()
        self.n, self.k = n_experts, k

    def forward(self, x):
        weights = torch.ones(x.size(0), self.k, device=x.device) / self.k
        indices = torch.arange(x.size(0) * self.k, device=x.device).view(-1, self.k) % self.n
        return weights.type_as(x), indices, None


def test_the_fake_gate_has_no_weight_and_saves_nothing():
    gate = _FakeBalancedGate(128, 4)
    assert not list(gate.parameters())
    x = torch.randn(16, 32, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        weights, indices, _ = gate(x)
    assert not saved and not weights.requires_grad and indices.dtype == torch.int64


@pytest.mark.parametrize("model", ["gpt-oss-120b", "qwen3-30b-a3b", "deepseek-v3"])
def test_the_option_drops_the_routers_parameters_and_saved_input(model):
    spec = get_model(model)
    fake = get_model(model, fake_balanced_gate=True)
    t = next(layer for c in spec.components for layer in c.layers if getattr(layer, "num_experts", 0))
    sparse = sum(1 for i in range(t.num_layers) if t.sparse_layer(i))
    bias = t.num_experts if model.startswith("gpt-oss") else 0  # gpt-oss's router has a bias
    router = sparse * (t.num_experts * t.hidden_size + bias)
    assert count_parameters(spec)["total"] - count_parameters(fake)["total"] == router
    cfg = TrainConfig(batch_size=1, seq_len=1024, precision="bf16", parallelism="fsdp", framework="nemo-automodel",
                      ep=8)
    real = estimate(model, cfg, "ml.p5.48xlarge")
    gated = estimate(model, cfg, "ml.p5.48xlarge", model_options={"fake_balanced_gate": True})
    # per sparse layer and row: the router's bf16 input (2h; DeepSeek-V3's shared expert reads and keeps the same
    # tensor, so it stays), at most its fp32 probabilities (4E), top-k indices, values and their sum (12k + 4)
    dropped = real.memory_bytes.activations - gated.memory_bytes.activations
    k, x = t.experts_per_token, 0 if t.shared_expert_intermediate_size else 2 * t.hidden_size
    assert sparse * 1024 * (x + 8 * k) <= dropped <= sparse * 1024 * (x + 4 * t.num_experts + 12 * k + 4)


def test_a_dense_model_refuses_the_option():
    r = CliRunner().invoke(app, ["estimate", "--model", "llama-3-8b", "-o", "fake_balanced_gate=true"])
    assert r.exit_code == 2 and "fake_balanced_gate" in r.output and len(r.output.strip().splitlines()) == 1


def test_the_probe_refuses_the_fake_gate():
    """The probe job builds the model's real router, so a probe of the fake gate would measure another model."""
    from planner.errors import PlannerError
    from planner.probes.spec import make_request

    cfg = TrainConfig(batch_size=1, seq_len=64, precision="bf16")
    with pytest.raises(PlannerError, match="fake_balanced_gate"):
        make_request("qwen3-30b-a3b", cfg, "ml.p5.48xlarge", model_options={"fake_balanced_gate": True},
                     with_estimate=False)
