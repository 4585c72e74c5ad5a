"""Model-state bytes against real torch modules and optimizers (CPU; the byte counts are device-independent)."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import BertConfig, BertForSequenceClassification

from planner.memory.optimizer import optimizer_state_bytes, optimizer_temporary_bytes
from planner.spec import TrainConfig


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=64)
    return BertForSequenceClassification(cfg).to(dtype)


def _one_step(model, opt):
    ids = torch.randint(0, 500, (2, 16))
    out = model(input_ids=ids, labels=torch.tensor([0, 1]))
    out.loss.backward()
    opt.step()


def _shapes(params) -> list[tuple[int, ...]]:
    return [tuple(p.shape) for p in params]


def _state_bytes(opt) -> int:
    """Every state tensor the optimizer keeps on the parameters' device, each storage once (bitsandbytes shares
    its quantisation maps). torch's `step` counters stay on the CPU unless fused/capturable."""
    device_step = bool(opt.defaults.get("fused") or opt.defaults.get("capturable"))
    seen, total = set(), 0
    for state in opt.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and (key != "step" or device_step):
                ptr = value.untyped_storage().data_ptr()
                if ptr not in seen:
                    seen.add(ptr)
                    total += value.untyped_storage().nbytes()
    return total


def _config(name: str, impl: str = "foreach") -> TrainConfig:
    return TrainConfig(batch_size=1, seq_len=1, optimizer=name, optimizer_impl=impl)


@pytest.mark.parametrize("name, impl, make, dtype", [
    ("adamw", "foreach", lambda p: torch.optim.AdamW(p, foreach=True), torch.float32),
    ("adam", "for-loop", lambda p: torch.optim.Adam(p, foreach=False), torch.float32),
    ("adamw", "fused", lambda p: torch.optim.AdamW(p, fused=True), torch.float32),
    ("adamw", "foreach", lambda p: torch.optim.AdamW(p), torch.bfloat16),
    ("sgd-momentum", "foreach", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), torch.float32),
    ("sgd", "foreach", lambda p: torch.optim.SGD(p, lr=0.1), torch.float32),
])
def test_optimizer_states_match_torch(name, impl, make, dtype):
    model = _model(dtype)
    opt = make(model.parameters())
    _one_step(model, opt)
    elem = torch.empty((), dtype=dtype).element_size()
    predicted = optimizer_state_bytes(_shapes(model.parameters()), _config(name, impl), elem)
    assert predicted == _state_bytes(opt)


def _adafactor(params):
    from transformers.optimization import Adafactor

    return Adafactor(params)  # transformers' defaults: beta1=None, relative_step=True, scale_parameter=True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_adafactor_states_match_transformers(dtype):
    """Factored row/col vectors for matrices, full vectors for 1-D tensors, fp32 whatever the dtype, RMS."""
    model = _model(dtype)
    opt = _adafactor(model.parameters())
    _one_step(model, opt)
    elem = torch.empty((), dtype=dtype).element_size()
    predicted = optimizer_state_bytes(_shapes(model.parameters()), _config("adafactor"), elem)
    assert predicted == _state_bytes(opt)
    assert all(isinstance(s["step"], int) for s in opt.state.values())  # Python ints, no device memory


def _loose_params(shapes, dtype=torch.float32):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


ODD_SHAPES = [(3, 4, 5), (7,), (6, 2), (1, 1), (2, 3, 4, 5), (9, 1)]


def test_adafactor_states_for_3d_and_4d_tensors():
    params = _loose_params(ODD_SHAPES)
    opt = _adafactor(params)
    opt.step()
    assert optimizer_state_bytes(ODD_SHAPES, _config("adafactor"), 4) == _state_bytes(opt)


def test_sharded_states_scale_with_share():
    shapes = [(10, 10), (10,)]
    full = optimizer_state_bytes(shapes, _config("adamw"), 4)
    assert full == 2 * 4 * 110
    assert optimizer_state_bytes(shapes, _config("adamw"), 4, share=0.25) == full // 4


@pytest.mark.parametrize("shapes", [
    [(4095,), (64, 64), (100, 100), (3,), (257, 16)],  # below / at / above min_8bit_size; partial blocks
    [(10,), (20, 20)],  # no 8-bit tensor: no quantisation maps
])
def test_adamw_8bit_states_match_bitsandbytes(shapes):
    bnb = pytest.importorskip("bitsandbytes")
    params = _loose_params(shapes)
    opt = bnb.optim.AdamW8bit(params)
    opt.step()
    assert optimizer_state_bytes(shapes, _config("adamw-8bit"), 4) == _state_bytes(opt)


# ------------------------------------------------------------------------------------ temporaries


class _PeakNewBytes(TorchDispatchMode):
    """Peak bytes of storages created while active and still alive: the step's temporaries (and new states).

    Storages are tracked by weak reference, so a temporary stops counting as soon as Python frees it; the
    ignored (pre-existing) ones too, so that a freed address reused by a new storage counts again.
    """

    def __init__(self, existing):
        super().__init__()
        self.known = {(ref := StorageWeakRef(t.untyped_storage())).cdata: ref for t in existing}
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.known = {k: ref for k, ref in self.known.items() if not ref.expired()}
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in self.known and ref.cdata not in self.live:
                    self.live[ref.cdata] = (ref, t.untyped_storage().nbytes())
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def _step_temporaries(opt, params) -> int:
    """Peak of the second step (states exist by then), beyond parameters, gradients and states."""
    opt.step()
    existing = [p for p in params] + [p.grad for p in params]
    existing += [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    mode = _PeakNewBytes(existing)
    with mode:
        opt.step()
    return mode.peak


SCALARS = 64  # 0-dim temporaries (norms, RMS, step counters): a few 4-byte tensors at a time


@pytest.mark.parametrize("name, impl, make", [
    ("adamw", "foreach", lambda p: torch.optim.AdamW(p, foreach=True)),
    ("adam", "foreach", lambda p: torch.optim.Adam(p, foreach=True)),
    ("adamw", "for-loop", lambda p: torch.optim.AdamW(p, foreach=False)),
    ("adam", "for-loop", lambda p: torch.optim.Adam(p, foreach=False)),
    ("sgd-momentum", "foreach", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True)),
    ("sgd-momentum", "for-loop", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=False)),
    ("adafactor", "foreach", _adafactor),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_temporaries_match_torch(name, impl, make, dtype):
    shapes = [(300, 40), (40,), (50, 300), (300,), (3, 20, 30), (7,)]
    params = _loose_params(shapes, dtype)
    opt = make(params)
    measured = _step_temporaries(opt, params)
    elem = torch.empty((), dtype=dtype).element_size()
    predicted = optimizer_temporary_bytes(shapes, _config(name, impl), elem)
    assert predicted <= measured <= predicted + SCALARS


def test_adafactor_peak_follows_the_previous_tensor():
    """The previous tensor's `update` lives until the next `grad**2 + eps`: two big neighbours cost more."""
    apart = [(200, 200), (5,), (200, 200)]
    together = [(5,), (200, 200), (200, 200)]
    for shapes in (apart, together):
        params = _loose_params(shapes)
        measured = _step_temporaries(_adafactor(params), params)
        predicted = optimizer_temporary_bytes(shapes, _config("adafactor"), 4)
        assert predicted <= measured <= predicted + SCALARS
    assert (optimizer_temporary_bytes(together, _config("adafactor"), 4)
            > optimizer_temporary_bytes(apart, _config("adafactor"), 4))
