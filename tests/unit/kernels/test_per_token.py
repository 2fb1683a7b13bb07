"""Per-token dynamic int8 linear: both integer GEMMs equal the grid written out from its definition
and the float simulation, on any token shape; error bounded per token; caches never go stale."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import ConfigValidationError, SerializationError
from qplug_core.kernels.cpu import override_cpu_flags
from qplug_core.kernels.per_token import (
    LEVELS,
    PerTokenDynamicLinear,
    SharedInput,
    best_gemm,
    onednn_is_exact,
    onednn_usable,
    per_token_quantize,
    weight_qmax,
)

#: the integer GEMMs this machine can run (oneDNN's needs AVX2 or better: a CPU property)
GEMMS = ["int_mm", pytest.param("onednn", marks=pytest.mark.skipif(
    not onednn_usable(), reason="oneDNN's int8 linear needs an x86 CPU with AVX2"))]
AVX2, VNNI = "avx2 fma", "avx2 avx512f avx512bw avx512_vnni"


def definition(linear: nn.Linear, x: torch.Tensor, qmax: int = 127) -> torch.Tensor:
    """The per-token linear written out in float64 from its definition, sharing no code with the
    module: symmetric weights in [-qmax, qmax] per output channel; each token's [min(x, 0),
    max(x, 0)] cut into LEVELS steps with an integer zero point; exact integer products."""
    w = linear.weight.detach().double()
    w_scale = w.abs().amax(1) / qmax
    w_int = torch.round(w / w_scale[:, None])
    rows = x.detach().double().reshape(-1, x.shape[-1])
    low, high = rows.amin(1, keepdim=True).clamp(max=0), rows.amax(1, keepdim=True).clamp(min=0)
    scale = (high - low).clamp(min=torch.finfo(torch.float32).eps) / LEVELS  # all-zero tokens
    zero_point = -torch.round(low / scale)
    codes = torch.round(rows / scale) + zero_point
    assert bool(((codes >= 0) & (codes <= 254)).all())  # with a level to spare: no clamp needed
    out = ((codes - zero_point) @ w_int.t()) * scale * w_scale + linear.bias.detach().double()
    return out.reshape(*x.shape[:-1], linear.out_features).float()

pytestmark = pytest.mark.usefixtures("plugin_autoload")


@pytest.mark.parametrize("gemm", GEMMS)
def test_int8_paths_match_the_simulation(gemm):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    x = torch.randn(3, 20, 64)
    x[0, 0, 5] = 80.0  # one outlier token
    int8 = PerTokenDynamicLinear.from_float(linear, gemm=gemm)
    assert int8.gemm == gemm and gemm in repr(int8)
    with torch.no_grad():
        if weight_qmax(gemm) == 127:  # the simulation's weights (without VNNI oneDNN's are 7-bit)
            simulated = PerTokenDynamicLinear.from_float(linear, simulate=True)
            torch.testing.assert_close(int8(x), simulated(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(int8(x), definition(linear, x, weight_qmax(gemm)).float(),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("shape", [(2, 9, 33), (37, 33), (1, 1, 33), (1, 33), (0, 33), (4, 2, 3, 33)])
def test_every_token_shape_equals_the_definition(gemm, shape):
    torch.manual_seed(1)
    linear = nn.Linear(33, 7)  # odd sizes: no vector-width multiple anywhere
    x = torch.randn(*shape) * torch.linspace(0.1, 10, 33)
    if x.numel():
        x.view(-1, 33)[0] = x.view(-1, 33)[0].abs() + 0.5  # one token entirely positive
    with torch.no_grad():
        got = PerTokenDynamicLinear.from_float(linear, gemm=gemm)(x)
        want = definition(linear, x, weight_qmax(gemm))
    assert got.shape == (*shape[:-1], 7) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_transposed_input_and_a_zero_token():
    torch.manual_seed(2)
    linear = nn.Linear(16, 5)
    x = torch.randn(16, 6).t()  # not contiguous
    x[3] = 0.0
    with torch.no_grad():
        module = PerTokenDynamicLinear.from_float(linear)
        got = module(x)
        torch.testing.assert_close(got, definition(linear, x, weight_qmax(module.gemm)).float(),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[3], linear.bias.detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("flags, onednn, qmax", [(VNNI, True, 127), (AVX2, True, 64),
                                                 ("sse2", False, 127)])
def test_the_cpu_decides_the_gemm_and_the_weight_range(flags, onednn, qmax, recwarn):
    """oneDNN with VNNI; on AVX2 without it, oneDNN with 7-bit weights (its int16 pair sums then
    cannot saturate); torch._int_mm, slower than fp32, only where neither is there, with a warning.
    oneDNN is taken only where it computes the worst case exactly on this host."""
    if not torch.backends.mkldnn.is_available():
        pytest.fail("this torch build has no oneDNN")
    with override_cpu_flags(flags):
        assert (onednn_usable(), weight_qmax("onednn")) == (onednn, qmax)
        module = PerTokenDynamicLinear.from_float(nn.Linear(16, 4))
    assert module.gemm == ("onednn" if onednn and onednn_is_exact(qmax) else "int_mm")
    assert int(module.weight_int8_t.abs().max()) == (qmax if module.gemm == "onednn" else 127)
    slower = [w for w in recwarn if "slower than fp32" in str(w.message)]
    assert len(slower) == (flags == "sse2")


def test_under_inference_mode_and_with_inference_tensors():
    torch.manual_seed(0)
    linear = nn.Linear(16, 8)
    shared = SharedInput()
    module = PerTokenDynamicLinear.from_float(linear, shared=shared)
    x = torch.randn(3, 16)
    expected = definition(linear, x, weight_qmax(module.gemm))
    with torch.inference_mode():
        y = torch.randn(3, 16)
        torch.testing.assert_close(module(x), expected, rtol=1e-5, atol=1e-5)
        first = module(y)
        y.mul_(2.0)  # no version counter on inference tensors: never served from the cache
        torch.testing.assert_close(module(y), definition(linear, y, weight_qmax(module.gemm)),
                                   rtol=1e-5, atol=1e-5)
    assert not torch.equal(first, module(y.clone()))



@pytest.mark.parametrize("gemm", GEMMS)
def test_one_token_at_a_time_equals_the_definition_and_the_batch(gemm):
    """A decode step (one token, the short path with Python-number qparams on oneDNN) gives what
    the definition and the batched call give, with and without a shared cache, and with an input
    that requires grad; q/k/v-style shared reuse serves the same codes to a second linear."""
    torch.manual_seed(3)
    first, second = nn.Linear(40, 24), nn.Linear(40, 8)
    shared = SharedInput()
    a = PerTokenDynamicLinear.from_float(first, gemm=gemm, shared=shared)
    b = PerTokenDynamicLinear.from_float(second, gemm=gemm, shared=shared)
    alone = PerTokenDynamicLinear.from_float(first, gemm=gemm)
    tokens = torch.randn(5, 40) * torch.linspace(0.1, 6, 40)
    tokens[1] = tokens[1].abs() + 0.25  # an all-positive token
    tokens[2] = 0.0
    with torch.no_grad():
        batched = a(tokens)
    for i in range(5):
        x = tokens[i].reshape(1, 1, 40).clone().requires_grad_(i == 3)
        with torch.no_grad():
            got, got_b, got_alone = a(x), b(x), alone(x)
        assert got.shape == (1, 1, 24)
        torch.testing.assert_close(got, definition(first, x, weight_qmax(gemm)), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_b, definition(second, x, weight_qmax(gemm)), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_alone[0, 0], batched[i], rtol=1e-5, atol=1e-5)

ONEDNN_AVX2_RUN = """
import json, torch
from qplug_core.kernels.cpu import override_cpu_flags
from qplug_core.kernels.per_token import PerTokenDynamicLinear, best_gemm, onednn_is_exact
torch.manual_seed(0)
linear = torch.nn.Linear(256, 64)
with torch.no_grad():
    linear.weight.abs_()  # same-sign neighbours: the worst case for int16 pair sums
x = torch.rand(32, 256) * 3
with override_cpu_flags("avx2 fma"):
    int8 = PerTokenDynamicLinear.from_float(linear)
simulated = PerTokenDynamicLinear(int8.weight_int8_t.t(), int8.weight_scale, linear.bias,
                                  simulate=True)
with torch.no_grad():
    off = float((int8(x) - simulated(x)).abs().max() / simulated(x).abs().max())
print(json.dumps({"exact": [onednn_is_exact(127), onednn_is_exact(64)], "gemm": int8.gemm,
                  "off": off, "vnni_flags_gemm": best_gemm()}))
"""


@pytest.mark.skipif(not onednn_usable(), reason="oneDNN's x86 int8 kernels")
def test_real_onednn_avx2_kernels_are_exact_with_the_derived_weights():
    """oneDNN capped at AVX2 (so this runs on any x86 CPU) saturates with 8-bit weights and is
    exact with the 7-bit ones the CPU rule picks there; with a VNNI CPU's flags but these kernels,
    the probe keeps oneDNN out."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "OMP_NUM_THREADS": "1",
           "QPLUG_CPU_FLAGS": VNNI}
    out = subprocess.run([sys.executable, "-c", ONEDNN_AVX2_RUN], env=env, capture_output=True,
                         text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["exact"] == [False, True]
    assert result["gemm"] == "onednn" and result["off"] < 1e-5
    assert result["vnni_flags_gemm"] == "int_mm"


def test_bad_gemm_names_the_choices():
    with pytest.raises(ConfigValidationError, match="gemm must be one of onednn, int_mm"):
        PerTokenDynamicLinear.from_float(nn.Linear(4, 4), gemm="mkl")
    assert best_gemm() == ("onednn" if onednn_usable() else "int_mm")
    with pytest.raises(ConfigValidationError, match="takes float32"):
        per_token_quantize(torch.randn(2, 4, dtype=torch.float64))


def test_an_outlier_token_does_not_cost_the_other_tokens_their_resolution():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    x = torch.randn(1, 32, 64)
    x[0, 0] *= 1000.0
    with torch.no_grad():
        want = linear(x)
        got = PerTokenDynamicLinear.from_float(linear)(x)
    rest = slice(1, None)
    assert qp.sqnr(want[0, rest], got[0, rest]) > 35  # per-tensor scales would give ~0 dB here


def test_quantize_rows_round_trip_within_half_a_step_and_zero_is_exact():
    x = torch.randn(10, 33) * torch.logspace(-3, 3, 10).unsqueeze(1)
    x[:, 0] = 0.0
    x[5] = x[5].abs()  # one-sided row: the whole grid goes to [0, max]
    q, scale, zero_point = per_token_quantize(x)
    assert q.dtype == torch.int8
    back = (q.float() - zero_point) * scale
    assert bool(((back - x).abs() <= scale / 2 + 1e-6 * x.abs()).all())
    assert bool((back[:, 0] == 0).all())
    assert float(scale[5]) == pytest.approx(float(x[5].max()) / LEVELS, rel=1e-6)


def test_shared_input_reuses_only_the_same_unchanged_tensor():
    shared = SharedInput()
    x = torch.randn(4, 8)
    first = shared.quantize(x)
    assert shared.quantize(x) is first
    x.mul_(2.0)  # in-place change: must be quantized again
    again = shared.quantize(x)
    assert again is not first
    torch.testing.assert_close(again[1], first[1] * 2)


def test_quantize_dynamic_per_token_swaps_linears_and_keeps_the_model_close():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)).eval()
    x = torch.randn(8, 32)
    qmodel = qp.quantize_dynamic(model, backend="fbgemm", per_token=True)
    assert all(isinstance(qmodel[i], PerTokenDynamicLinear) for i in (0, 2))
    assert isinstance(model[0], nn.Linear)  # the float model is untouched
    with torch.no_grad():
        assert qp.sqnr(model(x), qmodel(x)) > 30
    reference = qp.quantize_dynamic(model, backend="reference", per_token=True)
    assert reference[0].simulate
    with torch.no_grad():
        if weight_qmax(qmodel[0].gemm) == 127:  # else 7-bit weights (no VNNI): not the simulation's
            torch.testing.assert_close(reference(x), qmodel(x), rtol=1e-5, atol=1e-5)
        else:
            assert qp.sqnr(reference(x), qmodel(x)) > 30


def test_per_token_needs_int8():
    with pytest.raises(ConfigValidationError, match="per_token=True"):
        qp.quantize_dynamic(nn.Linear(4, 4), dtype=torch.float16, per_token=True, backend="fbgemm")


def test_caches_are_per_thread_and_copies_start_empty():
    import threading

    shared = SharedInput()
    linear = PerTokenDynamicLinear.from_float(nn.Linear(16, 8), shared=shared)
    x, y = torch.randn(20, 16), torch.randn(20, 16)
    want_x, want_y = linear(x), linear(y)
    got = {}
    worker = threading.Thread(target=lambda: got.setdefault("y", linear(y)))
    linear(x)  # this thread's cache now holds x
    worker.start()
    worker.join()
    torch.testing.assert_close(got["y"], want_y)
    torch.testing.assert_close(linear(x), want_x)
    torch.testing.assert_close(copy.deepcopy(linear)(y), want_y)


def test_copies_and_loaded_weights_repack_and_pickling_is_refused():
    import pickle

    torch.manual_seed(3)
    first, second = nn.Linear(24, 12), nn.Linear(24, 12)
    x = torch.randn(5, 24)
    a = PerTokenDynamicLinear.from_float(first)
    b = PerTokenDynamicLinear.from_float(second)
    want = a(x)  # packs a's weight (oneDNN) or allocates its accumulator
    b(x)
    torch.testing.assert_close(copy.deepcopy(a)(x), want, rtol=0, atol=0)
    with pytest.raises(SerializationError, match=r"cannot be pickled.*qp\.load\(path, model=float_model\)"):
        pickle.dumps(a)
    b.load_state_dict(a.state_dict())  # in place: the packed copy of b's old weight is stale
    torch.testing.assert_close(b(x), want, rtol=0, atol=0)


def test_threads_do_not_change_the_result():
    torch.manual_seed(4)
    linear = PerTokenDynamicLinear.from_float(nn.Linear(256, 96))
    x = torch.randn(4, 64, 256)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear(x)
        torch.set_num_threads(2)
        two = linear(x)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(one, two, rtol=1e-6, atol=1e-6)


def test_a_per_token_model_saves_and_loads_into_its_float_class(tmp_path):
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(12, 20), nn.GELU(), nn.Linear(20, 6)).eval()
    x = torch.randn(3, 12)
    qmodel = qp.quantize_dynamic(model, backend="fbgemm", per_token=True)
    path = qp.save(qmodel, tmp_path / "m.safetensors")
    fresh = nn.Sequential(nn.Linear(12, 20), nn.GELU(), nn.Linear(20, 6)).eval()
    loaded = qp.load(path, model=fresh)
    assert all(type(loaded[i]) is PerTokenDynamicLinear for i in (0, 2))
    with torch.no_grad():
        assert torch.equal(loaded(x), qmodel(x))


def test_qp_save_refuses_a_captured_per_token_graph_and_quantizing_again_reproduces_it(tmp_path):
    from qplug_core.errors import SerializationError

    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(12, 20), nn.GELU(), nn.Linear(20, 6)).eval()
    x = torch.randn(3, 12)
    options = {"capture": "export", "example_inputs": (x,)}
    qmodel = qp.quantize_dynamic(model, backend="fbgemm", per_token=True, **options)
    with pytest.raises(SerializationError, match="run qp.quantize_dynamic again"):
        qp.save(qmodel, tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()
    again = qp.quantize_dynamic(model, backend="fbgemm", per_token=True, **options)
    with torch.no_grad():
        assert torch.equal(again(x), qmodel(x))  # deterministic: the documented way to restore it


def test_a_hugging_face_bert_quantizes_query_key_value_input_once(monkeypatch):
    from transformers import BertConfig, BertModel

    from qplug_core.kernels import per_token

    torch.manual_seed(6)
    config = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=16)
    model = BertModel(config, add_pooling_layer=False).eval()
    tokens, mask = torch.randint(0, 50, (2, 9)), torch.ones(2, 9, dtype=torch.long)
    qmodel = qp.quantize_dynamic(model, backend="fbgemm", per_token=True)
    quantized = []
    original = per_token._quantize

    def counting(x, *args, **kwargs):  # a spy: the real quantization still runs
        quantized.append(x.shape)
        return original(x, *args, **kwargs)

    monkeypatch.setattr(per_token, "_quantize", counting)
    with torch.no_grad():
        got = qmodel(tokens, attention_mask=mask).last_hidden_state
        want = model(tokens, attention_mask=mask).last_hidden_state
    # per layer: q/k/v's shared input, attention output, FFN in, FFN out (6 linears, 4 inputs)
    assert len(quantized) == 2 * 4
    assert qp.sqnr(want, got) > 25
