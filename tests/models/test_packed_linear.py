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


# oneDNN's bfloat16 GEMM needs AVX512 (emulated) or AVX512-BF16/AMX (native); elsewhere set_cpu_gemm_dtype refuses
ONEDNN_BF16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()


def refused_without_onednn_bf16(module: torch.nn.Module) -> bool:
    """True (after checking the refusal) on CPUs without a oneDNN bfloat16 GEMM, where a bf16 test has nothing to run."""
    if ONEDNN_BF16:
        return False
    with pytest.raises(ValueError, match="no oneDNN bfloat16 GEMM"):
        layers.set_cpu_gemm_dtype(module, torch.bfloat16)
    return True


def linear(seed: int = 0) -> tuple[Linear, torch.Tensor]:
    torch.manual_seed(seed)
    return Linear(24, 40).eval(), torch.randn(3, 5, 24)  # the packed path is for inference: eval mode


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


def test_training_mode_never_packs_so_a_fused_step_cannot_be_missed():
    """A no-grad call in training mode (a loss logged between steps) takes the plain path: a fused AdamW step after
    it, which leaves `_version` alone, is seen by the next call."""
    lin, x = linear()
    lin.train()
    opt = torch.optim.AdamW(lin.parameters(), lr=0.5, fused=True)
    with torch.no_grad():
        lin(x)
    assert lin._packed is None
    lin(x).sum().backward()
    opt.step()
    with torch.no_grad():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)


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


@pytest.mark.parametrize("activation", ["none", "gelu"])
def test_bf16_gemm_is_float32_in_and_out_and_close_to_float32(activation):
    lin, x = linear()
    if refused_without_onednn_bf16(lin):
        return
    with torch.no_grad():
        ref = lin(x, activation=activation)
        assert layers.set_cpu_gemm_dtype(lin, torch.bfloat16) == 1
        out = lin(x, activation=activation)
    assert lin._packed[1].dtype == torch.bfloat16  # the packed copy is bfloat16, the parameter stays float32
    assert out.dtype == torch.float32 and lin.weight.dtype == torch.float32
    assert not torch.equal(out, ref)  # it really ran in bfloat16 (8 mantissa bits)
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=2e-2)


def test_gemm_dtype_switch_repacks_and_training_is_unaffected():
    lin, x = linear()
    if refused_without_onednn_bf16(lin):
        return
    with torch.no_grad():
        layers.set_cpu_gemm_dtype(lin, torch.bfloat16)
        lin(x)
        layers.set_cpu_gemm_dtype(lin, torch.float32)
        back = lin(x)
    assert lin._packed[1].dtype == torch.float32
    torch.testing.assert_close(back, F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
    layers.set_cpu_gemm_dtype(lin, torch.bfloat16)
    y = lin(x)  # grad mode: the plain float32 path, exact
    assert torch.equal(y, F.linear(x, lin.weight, lin.bias))


def test_gemm_dtype_is_set_on_every_linear_and_checked():
    model = torch.nn.Sequential(Linear(4, 4), torch.nn.Sequential(Linear(4, 4)), torch.nn.Linear(4, 4)).eval()
    if refused_without_onednn_bf16(model):
        return
    assert layers.set_cpu_gemm_dtype(model, torch.bfloat16) == 2
    assert [m.gemm_dtype for m in model.modules() if isinstance(m, Linear)] == [torch.bfloat16] * 2
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        layers.set_cpu_gemm_dtype(model, torch.float16)


def test_native_bf16_detection_reads_the_cpu_flags_and_the_onednn_cap(monkeypatch):
    flags = open("/proc/cpuinfo").read().split() if layers.Path("/proc/cpuinfo").exists() else []
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert layers.cpu_has_native_bf16() == native
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert layers.cpu_has_native_bf16() == native
    for cap in ("AVX512_CORE", "avx2", "SSE41"):  # oneDNN capped below its bfloat16 level emulates bfloat16
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        assert not layers.cpu_has_native_bf16()


def test_gemm_out_keeps_bf16_between_gemms():
    lin, x = linear()
    nxt = Linear(40, 8).eval()
    if refused_without_onednn_bf16(lin):
        return
    with torch.no_grad():
        ref = nxt(lin(x, activation="gelu"))
        layers.set_cpu_gemm_dtype(torch.nn.ModuleList([lin, nxt]), torch.bfloat16)
        hidden = lin(x, activation="gelu", gemm_out=True)
        out = nxt(hidden)  # a bfloat16 input takes the fast path too
    assert hidden.dtype == torch.bfloat16 and out.dtype == torch.float32
    assert nxt._packed is not None
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=2e-2)
    with torch.no_grad():  # float32 GEMMs: gemm_out changes nothing
        layers.set_cpu_gemm_dtype(torch.nn.ModuleList([lin, nxt]), torch.float32)
        assert lin(x, gemm_out=True).dtype == torch.float32


@pytest.mark.parametrize("step", ["fused_adamw", "foreach"])
def test_in_place_updates_without_a_version_bump_are_not_served_stale(step):
    """Fine-tune's periodic eval: eval() -> pack -> train() -> fused AdamW steps (no _version bump) -> eval() again."""
    lin, x = linear()
    lin.eval()
    with torch.no_grad():
        lin(x)  # packs
    lin.train()
    if step == "fused_adamw":
        opt = torch.optim.AdamW(lin.parameters(), lr=0.5, fused=True)
        lin(x).sum().backward()
        opt.step()
    else:
        with torch.no_grad():
            torch._foreach_add_([lin.weight, lin.bias], [torch.ones_like(lin.weight), torch.ones_like(lin.bias)])
    lin.eval()
    with torch.no_grad():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
