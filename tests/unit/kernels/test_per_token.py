"""Per-token dynamic int8 linear: int8 path equals its float simulation, error bounded per token."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import ConfigValidationError
from qplug_core.kernels.per_token import (
    LEVELS,
    PerTokenDynamicLinear,
    SharedInput,
    per_token_quantize,
)

pytestmark = pytest.mark.usefixtures("plugin_autoload")


def test_int8_path_matches_the_simulation():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    x = torch.randn(3, 20, 64)
    x[0, 0, 5] = 80.0  # one outlier token
    int8 = PerTokenDynamicLinear.from_float(linear)
    simulated = PerTokenDynamicLinear.from_float(linear, simulate=True)
    torch.testing.assert_close(int8(x), simulated(x), rtol=1e-6, atol=1e-6)


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
        torch.testing.assert_close(reference(x), qmodel(x), rtol=1e-5, atol=1e-5)


def test_per_token_needs_int8():
    with pytest.raises(ConfigValidationError, match="per_token=True"):
        qp.quantize_dynamic(nn.Linear(4, 4), dtype=torch.float16, per_token=True, backend="fbgemm")


def test_caches_are_per_thread_and_copies_start_empty():
    import copy
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
