"""``WeightOnlyEmbeddingBag`` against ``nn.EmbeddingBag``'s definition over the dequantized table
(float64), on torch's fused bag ops and on the dequantize-then-reduce path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qplug_core.kernels.weight_only_scheme import WeightOnlyScheme, quantize
from qplug_core.weight_only import WeightOnlyEmbeddingBag

ROWS, DIM, PAD = 40, 16, 5
#: the fused 4-bit op keeps scale and bias in float16 (2**-11 relative); sums are float32
CONTRACT = {8: 2.0 ** -20, 4: 2.0 ** -10}

# (bits, symmetric, group_size): one scale per row runs the fused op, groups within a row do not
SCHEMES = [(8, True, None, True), (8, False, None, True), (4, True, None, True), (4, False, DIM, True),
           (8, False, 8, False), (4, True, 8, False)]


def _bags(kind: str):
    """(ids, offsets, per_sample_weights, include_last_offset) of one call."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, ROWS, (15,), generator=g)
    ids[[1, 7, 8]] = PAD
    if kind == "2d":
        return ids[:12].view(4, 3), None, None, False
    offsets = torch.tensor([0, 4, 4, 9, 13])  # an empty bag and a last bag of two
    weights = torch.rand(15, generator=g) if kind == "weighted" else None
    if kind == "last_offset":
        return ids, torch.cat([offsets, torch.tensor([15])]), None, True
    return ids, offsets, weights, False


@pytest.mark.parametrize(("bits", "symmetric", "group_size", "fused"), SCHEMES)
@pytest.mark.parametrize("padding_idx", [None, PAD])
@pytest.mark.parametrize(("mode", "kind"), [("sum", "offsets"), ("sum", "weighted"), ("sum", "last_offset"),
                                            ("sum", "2d"), ("mean", "offsets"), ("mean", "last_offset"),
                                            ("mean", "2d")])  # per_sample_weights: mode sum only
def test_bags_match_the_definition(bits, symmetric, group_size, fused, mode, padding_idx, kind):
    torch.manual_seed(0)
    weight = quantize(torch.randn(ROWS, DIM), WeightOnlyScheme(bits, group_size, symmetric))
    bag = WeightOnlyEmbeddingBag(weight, mode, include_last_offset=kind == "last_offset", padding_idx=padding_idx)
    assert (bag.fused_table() is not None) == fused
    ids, offsets, weights, last = _bags(kind)
    table = weight.dequantize(torch.float64)
    expected = F.embedding_bag(ids, table, offsets, mode=mode, include_last_offset=last, padding_idx=padding_idx,
                               per_sample_weights=None if weights is None else weights.double())
    # what the scales' rounding can move: |scale| * 2 * qmax per entry, summed as the bag sums
    reach = (weight.scales.double() * 2 * weight.scheme.qmax).amax(1, keepdim=True).expand(ROWS, DIM)
    bound = F.embedding_bag(ids, reach, offsets, mode=mode, include_last_offset=last, padding_idx=padding_idx,
                            per_sample_weights=None if weights is None else weights.double())
    error = (bag(ids, offsets, weights).double() - expected).abs()
    assert bool((error <= CONTRACT[bits] * bound + 1e-12).all()), float((error - CONTRACT[bits] * bound).max())


def test_a_table_float16_cannot_scale_keeps_the_dequantize_path():
    """A 4-bit row of weights near 1e-6 has a scale float16 holds only as a subnormal."""
    weight = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0))
    weight[3] *= 1e-6
    weight[4] = 0  # a row of zeros: still fused-friendly
    assert WeightOnlyEmbeddingBag(quantize(weight[[0, 4]], WeightOnlyScheme(4)), "sum").fused_table() is not None
    bag = WeightOnlyEmbeddingBag(quantize(weight, WeightOnlyScheme(4)), "sum")
    assert bag.fused_table() is None
    ids, offsets = torch.tensor([3, 3, 1]), torch.tensor([0, 2])
    expected = F.embedding_bag(ids, bag.quantized_weight().dequantize(torch.float64), offsets, mode="sum")
    torch.testing.assert_close(bag(ids, offsets).double(), expected, rtol=1e-6, atol=1e-12)
