"""Weight-only kernels against the float64 definition ``x @ ((q - zero_point) * scale).T + b``
(:mod:`qplug_core.testing.weight_only`: integers read back from the stored bytes by their own route)."""

from __future__ import annotations

import pytest
import torch

from qplug_core.errors import ConfigValidationError
from qplug_core.kernels.weight_only import CORE_KERNELS, ReferenceKernel, RowSplitKernel, WeightOnlyKernel
from qplug_core.kernels.weight_only_scheme import quantize
from qplug_core.testing.weight_only import definition
from qplug_core.weight_only import WeightOnlyLinear, WeightOnlyScheme, selection
from qplug_core.weight_only.selection import choose, clear_cache, definition_problem

KERNELS = {k.name: k for k in CORE_KERNELS}


CASES = [  # (kernel, bits, group_size, symmetric, out_features, in_features)
    ("reference", 8, None, True, 37, 50),
    ("reference", 8, 32, False, 37, 96),
    ("reference", 4, 32, True, 37, 96),
    ("reference", 4, 16, False, 5, 48),
    ("reference", 4, None, False, 7, 33),  # odd K: the last byte of each row holds one value
    ("torch-int8pack", 8, None, True, 37, 96),
    ("torch-int4pack", 4, 32, True, 48, 96),
    ("torch-int4pack", 4, 32, False, 48, 96),
    ("torch-int4pack", 4, 64, False, 32, 192),
]


@pytest.mark.parametrize(("name", "bits", "group_size", "symmetric", "n", "k"), CASES)
def test_kernel_computes_the_definition(name, bits, group_size, symmetric, n, k):
    g = torch.Generator().manual_seed(n * k + bits)
    scheme = WeightOnlyScheme(bits, group_size, symmetric)
    weight = quantize(torch.randn(n, k, generator=g) * 0.1, scheme)
    kernel = KERNELS[name]
    assert kernel.supports(scheme, (n, k), torch.float32) is None
    x, bias = torch.randn(5, k, generator=g), torch.randn(n, generator=g)
    expected = x.double() @ definition(weight).T + bias.double()
    got = kernel.run(kernel.pack(weight), x, bias)
    assert got.shape == (5, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("bits", "group_size", "symmetric"), [(8, None, True), (4, 32, False)])
def test_module_takes_3d_inputs(bits, group_size, symmetric):
    g = torch.Generator().manual_seed(3)
    weight = quantize(torch.randn(24, 64, generator=g), WeightOnlyScheme(bits, group_size, symmetric))
    bias = torch.randn(24, generator=g)
    module = WeightOnlyLinear(weight, bias)
    kernel, packed, _ = choose(weight, list(CORE_KERNELS))
    module.use_kernel(kernel, packed)
    x = torch.randn(2, 3, 64, generator=g)
    expected = x.double() @ definition(weight).T + bias.double()
    torch.testing.assert_close(module(x).double(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("bits", "symmetric"), [(8, True), (8, False), (4, True), (4, False)])
def test_rtn_rounds_every_weight_to_its_nearest_step(bits, symmetric):
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(bits)).double()
    weight = quantize(w, WeightOnlyScheme(bits, 16, symmetric))
    step = weight.scales.double().repeat_interleave(16, dim=1)
    assert bool(((definition(weight) - w).abs() <= step / 2 + 1e-6).all())


def test_kernels_refuse_what_they_cannot_run():
    shape = (32, 96)
    assert "symmetric int8 only" in KERNELS["torch-int8pack"].supports(WeightOnlyScheme(4, 32), shape,
                                                                        torch.float32)
    assert "per output channel" in KERNELS["torch-int8pack"].supports(WeightOnlyScheme(8, 32), shape,
                                                                       torch.float32)
    assert "group_size one of" in KERNELS["torch-int4pack"].supports(WeightOnlyScheme(4, 16), (32, 96),
                                                                      torch.float32)
    assert "multiple of 16" in KERNELS["torch-int4pack"].supports(WeightOnlyScheme(4, 32), (40, 96),
                                                                   torch.float32)
    assert ReferenceKernel().supports(WeightOnlyScheme(), shape, torch.int8) is not None


class DropsZeroPoints(ReferenceKernel):
    """A kernel with a packing bug: it forgets asymmetric zero points."""

    name = "drops-zero-points"

    def pack(self, weight):
        return type(weight)(weight.scheme, weight.shape, weight.data, weight.scales, None)


class Raises(ReferenceKernel):
    name = "raises"

    def run(self, packed, x, bias):
        raise RuntimeError("unsupported shape")


def test_selection_drops_wrong_and_failing_kernels():
    weight = quantize(torch.randn(16, 64, generator=torch.Generator().manual_seed(0)),
                      WeightOnlyScheme(4, 32, symmetric=False))
    assert definition_problem(weight, DropsZeroPoints(), DropsZeroPoints().pack(weight)).startswith("relative error")
    kernel, _, choice = choose(weight, [DropsZeroPoints(), Raises(), ReferenceKernel()])
    assert kernel.name == "reference"
    assert "relative error" in choice.rejected["drops-zero-points"]
    assert "unsupported shape" in choice.rejected["raises"]
    with pytest.raises(ConfigValidationError, match=r"'drops-zero-points' is wrong on a \[out 16, in 64\] weight \(relative error"):
        choose(weight, [DropsZeroPoints()], forced="drops-zero-points")
    with pytest.raises(ConfigValidationError, match="did you mean 'reference'"):
        choose(weight, [ReferenceKernel()], forced="refrence")


class Dequantized(WeightOnlyKernel):
    """Dequantizes once, at pack, to float16 (a float32 copy is refused: no smaller than the float
    weight): then a plain ``F.linear``, about as fast as float at every row count. Counts the rows
    it ran."""

    name = "dequantized-once"

    def __init__(self):
        self.rows: list[int] = []

    def supports(self, scheme, shape, activation_dtype):
        return None

    def pack(self, weight):
        return weight.dequantize(torch.float16)

    def run(self, packed, x, bias):
        self.rows.append(x.shape[0])
        return torch.nn.functional.linear(x, packed.to(x.dtype), bias)


class RowByRow(Dequantized):
    """A decode kernel: one call per activation row, so its time grows with the rows (as torch's
    packed ops' does) while dequantize-then-matmul pays once per call."""

    name = "row-by-row"

    def run(self, packed, x, bias):
        self.rows.append(x.shape[0])
        return torch.cat([torch.nn.functional.linear(row, packed.to(x.dtype), bias) for row in x.split(1)])


@pytest.mark.usefixtures("one_thread")  # timed: no thread waiting for a busy core
def test_a_decode_kernel_takes_the_rows_it_wins_and_the_reference_the_rest():
    """Chosen at batch 1, a kernel whose time grows with the rows ran all-MiniLM-L6-v2's 8 x 128
    tokens 130x slower than float (torch's int4 op): above the row count where it first loses
    to dequantize-then-matmul, the layer runs that instead (one call per row at 256 rows: ~10x
    the reference here, at one row a fraction of it)."""
    clear_cache()
    weight = quantize(torch.randn(512, 512, generator=torch.Generator().manual_seed(1)), WeightOnlyScheme(4, 32))
    few = RowByRow()
    kernel, packed, choice = choose(weight, [few, ReferenceKernel()])
    assert isinstance(kernel, RowSplitKernel) and kernel.few is few, choice
    lost_at = max(choice.by_rows_ms)  # the race stops where the kernel first loses
    assert choice.by_rows_ms[lost_at][0] > choice.by_rows_ms[lost_at][1], choice
    assert kernel.max_rows == max([1, *(rows for rows in choice.by_rows_ms if rows < lost_at)])
    module = WeightOnlyLinear(weight, None)
    module.use_kernel(kernel, packed)
    for rows in (1, 300):
        few.rows.clear()
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        # float16 weights below the split, the reference's float32 above
        tolerance = 1e-2 if rows == 1 else 1e-4
        torch.testing.assert_close(module(x).double(), x.double() @ definition(weight).T, rtol=tolerance,
                                   atol=tolerance)
        assert few.rows == ([1] if rows == 1 else [])
    # the next layer of the shape reuses the split, each part checked on its weights
    again, _, measured = choose(weight, [few, ReferenceKernel()])
    assert measured is None and isinstance(again, RowSplitKernel) and again.max_rows == kernel.max_rows


@pytest.mark.usefixtures("one_thread")  # timed: no thread waiting for a busy core
def test_a_kernel_as_fast_at_every_row_count_is_not_split(monkeypatch):
    """Raced at up to 16 rows, where the reference's dequantization is most of its time (at 256
    the two are within ~1.5x: a tie for this test, not a decision)."""
    monkeypatch.setattr(selection, "SPLIT_ROWS", (4, 16))
    clear_cache()
    weight = quantize(torch.randn(512, 512, generator=torch.Generator().manual_seed(2)), WeightOnlyScheme(4, 32))
    fast = Dequantized()
    kernel, _, choice = choose(weight, [fast, ReferenceKernel()])
    assert kernel is fast and sorted(choice.by_rows_ms) == [4, 16], choice


@pytest.mark.usefixtures("one_thread")
def test_a_kernel_slower_than_float_at_one_row_is_said():
    """The reference dequantizes on every call, ~20x float ``F.linear``'s one-row time at this size;
    torch's packed ops are 4-12x slower than float on the x86 CPUs measured: a model quantized for
    speed must not come back slower without a word. Within 1.25x of float is timing noise."""
    clear_cache()
    weight = quantize(torch.randn(512, 512, generator=torch.Generator().manual_seed(4)), WeightOnlyScheme(4, 32))
    _, _, measured = choose(weight, [ReferenceKernel()])
    assert measured.timings_ms["reference"] > 0 and measured.float_ms > 0, measured  # both timed
    # the verdict from timings (measured ones depend on the machine's load: the message is tested here)
    alone = selection.Choice(ReferenceKernel(), {"reference": 20.0}, float_ms=1.0)
    as_fast = selection.Choice(Dequantized(), {"dequantized-once": 1.2}, float_ms=1.0)
    assert selection.slower_than_float([as_fast]) == ""
    message = selection.slower_than_float([as_fast, alone])
    assert "slower than float F.linear (reference:" in message and "on 1 of 2 layer shape(s)" in message
    assert "qplug-onnxruntime" in message
    plugin_kernel = selection.Choice(Dequantized(), {"dequantized-once": 2.0}, float_ms=1.0)
    assert "dequantized-once is the fastest installed" in selection.slower_than_float([plugin_kernel])


def test_scheme_validates_its_fields():
    with pytest.raises(ConfigValidationError, match="bits must be one of"):
        WeightOnlyScheme(bits=3)
    with pytest.raises(ConfigValidationError, match="group_size must be an even int"):
        WeightOnlyScheme(bits=4, group_size=7)
    with pytest.raises(ConfigValidationError, match="does not divide"):
        quantize(torch.randn(4, 40), WeightOnlyScheme(4, 32))
