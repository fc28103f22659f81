"""models.layers.Linear: the pre-packed oneDNN inference path equals F.linear and never serves stale weights."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from models import layers
from models.layers import Linear



def test_pinned_torch_has_the_onednn_linear():
    """The encoder's CPU speed-up (docs/BENCHMARKS.md) rests on it: a torch without it must fail here, not skip."""
    assert layers._ONEDNN_LINEAR


def linear(seed: int = 0) -> tuple[Linear, torch.Tensor]:
    torch.manual_seed(seed)
    return Linear(24, 40), torch.randn(3, 5, 24)


@pytest.mark.parametrize("activation", ["none", "gelu"])
def test_packed_path_equals_plain_linear(activation):
    lin, x = linear()
    ref = F.linear(x, lin.weight, lin.bias)
    ref = F.gelu(ref) if activation == "gelu" else ref
    with torch.no_grad():
        out = lin(x, activation=activation)
    assert lin._packed is not None  # the packed path ran
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_grad_mode_takes_the_plain_path_and_gets_gradients():
    lin, x = linear()
    lin(x).sum().backward()
    assert lin._packed is None and lin.weight.grad is not None


def test_changed_weights_are_repacked():
    lin, x = linear()
    with torch.inference_mode():
        lin(x)
    with torch.no_grad():
        lin.weight.mul_(2.0)  # in place, as an optimizer step
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
    other, _ = linear(seed=1)
    lin.load_state_dict(other.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(lin(x), other(x), atol=1e-5, rtol=1e-5)


def test_packed_copy_is_not_saved_copied_or_pickled():
    lin, x = linear()
    with torch.no_grad():
        lin(x)
    assert set(lin.state_dict()) == {"weight", "bias"}
    for clone in (copy.deepcopy(lin), pickle.loads(pickle.dumps(lin))):
        assert clone._packed is None
        with torch.no_grad():
            torch.testing.assert_close(clone(x), lin(x))


def test_switch_off(monkeypatch):
    monkeypatch.setattr(layers, "PACK_CPU_WEIGHTS", False)
    lin, x = linear()
    with torch.no_grad():
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
    assert lin._packed is None
