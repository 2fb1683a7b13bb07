"""A model captured by torch.export serves the image sizes it was calibrated with (s29 detseg §3):
every Hugging Face detector and segmenter quantized at 320x320 refused 256x384, though the user
calibrated with both. ``qplug_core/flows/image_sizes.py``, ``qplug_core/ir/capture.py``."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

import qplug_core as qp

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


class BranchOnSize(nn.Module):
    """A segmenter whose forward branches on its input's size, as Hugging Face's do: symbolic
    tracing fails, torch.export takes it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[2:]
        if h > 0:
            x = self.body(x)
        return F.interpolate(x, size=(h, w), mode="bilinear")


def _images(*sizes: tuple[int, int]) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(1, 3, *size) for size in sizes for _ in range(2)]


def _answers_like(int8: nn.Module, reference: nn.Module, x: torch.Tensor) -> None:
    """``int8`` gives the output of the reference form (``backend="reference"``) within an int8 step."""
    got, expected = int8(x), reference(x)
    assert got.shape == x.shape[:1] + (4,) + x.shape[2:]
    assert torch.allclose(got, expected, atol=0.05), float((got - expected).abs().max())


@pytest.mark.slow  # two captures with two torch.exports each: 4-8 s on a loaded 2-core machine
def test_calibrated_at_two_sizes_it_runs_at_both_and_says_nothing():
    data = _images((32, 32), (24, 40))
    model = BranchOnSize().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing fixed, nothing to say
        int8 = qp.quantize(model, data[0], data, backend="fbgemm")
    reference = qp.quantize(model, data[0], data, backend="reference")
    assert qp.quantization_report(int8).capture == "export"
    for x in (data[0], data[-1], torch.randn(1, 3, 48, 16)):  # and a size the graph allows
        _answers_like(int8, reference, x)


@pytest.mark.slow  # one torch.export
def test_calibrated_at_one_size_it_refuses_another_as_before():
    data = _images((32, 32))
    with pytest.warns(UserWarning, match=r"fixing image sizes \(one size calibrated\): it takes 'x' 32x32 only"):
        int8 = qp.quantize(BranchOnSize().eval(), data[0], data, backend="fbgemm")
    with pytest.raises(qp.errors.InputMismatchError, match="captured with 32"):
        int8(torch.randn(1, 3, 24, 40))


@pytest.mark.slow  # one torch.export
def test_dynamic_shapes_are_passed_to_torch_export():
    data = _images((32, 32))
    shapes = ({2: 8 * Dim("h", min=2, max=16), 3: 8 * Dim("w", min=2, max=16)},)
    model = BranchOnSize().eval()
    int8 = qp.quantize(model, data[0], data, backend="reference", dynamic_shapes=shapes)
    x = torch.randn(1, 3, 24, 40)
    assert F.cosine_similarity(int8(x).flatten(), model(x).flatten(), dim=0) > 0.999


def test_dynamic_shapes_of_another_form_are_refused_before_capture():
    data = _images((32, 32))
    with pytest.raises(qp.errors.ConfigValidationError, match=r"one entry per example input \(1\).*got tuple of 2"):
        qp.quantize(BranchOnSize().eval(), data[0], data, backend="fbgemm", dynamic_shapes=({2: Dim("h")}, None))


class PositionTable(nn.Module):
    """ViT/DPT style: a learned table per patch, not interpolated, fixes the grid: no dynamic size
    can take another."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 8, 4, stride=4)
        self.position_embeddings = nn.Parameter(torch.randn(1, 8, 8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.patch(x) + self.position_embeddings if x.shape[2] > 0 else x


@pytest.mark.slow  # one torch.export
def test_a_position_table_is_told_to_quantize_once_per_size():
    data = _images((32, 32))
    with pytest.warns(UserWarning, match="fixing image sizes") as caught:
        qp.quantize(PositionTable().eval(), data[0], data, backend="reference")
    said = next(str(w.message) for w in caught if "fixing image sizes" in str(w.message))
    assert "position table that does not interpolate fixes it: quantize once per size" in said
    assert "dynamic_shapes" not in said


def test_dynamic_shapes_for_a_capture_that_exports_nothing_are_refused():
    shapes = ({2: Dim("h")},)
    data = _images((32, 32))
    with pytest.raises(qp.errors.ConfigValidationError, match="capture='symbolic' does not run"):
        qp.prepare_fx(nn.Conv2d(3, 4, 3), None, data[0], capture="symbolic", dynamic_shapes=shapes)
    graph = torch.fx.symbolic_trace(nn.Conv2d(3, 4, 3))
    with pytest.raises(qp.errors.ConfigValidationError, match="a captured GraphModule does not run"):
        qp.prepare_fx(graph, None, data[0], dynamic_shapes=shapes)
