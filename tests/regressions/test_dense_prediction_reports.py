"""Defects a detection/segmentation user found (s27 dense, 2026-12-07): each test is that user's
own call, with the numbers or the error they rely on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


class SharedHead(nn.Module):
    """RetinaNet/FCOS style: one ``nn.Sequential`` tower and classifier called on every FPN level."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.down = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.tower = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.cls = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        p3 = self.stem(x)
        return [self.cls(self.tower(p)) for p in (p3, self.down(p3))]


def test_a_shared_sequential_head_is_saved_and_loaded(tmp_path):
    """F5: the second call's copy of ``tower.0`` was named ``tower.0_call1``, which ``qp.save``
    refused ("attribute path 'tower.0_call1' is not a dotted path of identifiers or indices")."""
    torch.manual_seed(0)
    data = [torch.randn(1, 3, 16, 16) for _ in range(3)]
    quantized = qp.quantize(SharedHead().eval(), data[0], data[:2], backend="fbgemm")
    loaded = qp.load(qp.save(quantized, tmp_path / "head.safetensors"))
    with torch.no_grad():
        before, after = quantized(data[2]), loaded(data[2])
    assert type(after) is list and all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


class ConvBnHardswish(nn.Module):
    def __init__(self, inputs: int, outputs: int, kernel: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(inputs, outputs, kernel, padding=kernel // 2, bias=False)
        self.bn = nn.BatchNorm2d(outputs)
        self.act = nn.Hardswish()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))


class C2f(nn.Module):
    """Ultralytics' C2f block (Hardswish variant): cv1, cut in two, a bottleneck on the last piece,
    cat of all pieces, cv2. ``y[0], y[1]`` instead of ``list(...)`` keeps it symbolically traceable."""

    def __init__(self, split: bool) -> None:
        super().__init__()
        self.stem = ConvBnHardswish(3, 8, 3)
        self.cv1, self.m, self.cv2 = ConvBnHardswish(8, 16), ConvBnHardswish(8, 8, 3), ConvBnHardswish(24, 8)
        self.split = split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.cv1(self.stem(x))
        pieces = y.split((8, 8), 1) if self.split else y.chunk(2, 1)
        return self.cv2(torch.cat([pieces[0], pieces[1], self.m(pieces[1])], 1))


@pytest.mark.parametrize(("capture", "split"), [("symbolic", True), pytest.param("export", False, marks=pytest.mark.slow)],
                         ids=["symbolic-split", "export-chunk"])  # export: ~3 s
def test_a_c2f_block_cuts_its_int8_tensor_without_dequantizing(capture, split):
    """F2: chunk / split had no pattern (and no ATen mapping under export), so every C2f
    dequantized after cv1 and kept its activation float ("its output feeds no int8 op")."""
    torch.manual_seed(0)
    model = C2f(split).eval()
    data = [torch.randn(1, 3, 16, 16) for _ in range(3)]
    int8 = qp.quantize(model, data[0], data[:2], backend="fbgemm", capture=capture)
    reference = qp.quantize(model, data[0], data[:2], backend="reference", capture=capture)
    report = qp.quantization_report(int8)
    cut = next(node for node in report.kernels if node.startswith(("split", "chunk")))
    assert report.kernels[cut] == "passthrough"
    (last,) = report.skipped  # only cv2's activation, the model's output, stays float
    assert "its output feeds no int8 op" in last.reason
    with torch.no_grad():
        assert qp.sqnr(reference(data[2]), int8(data[2])) > 40


class UltralyticsC2f(C2f):
    """C2f as Ultralytics writes it: ``list(...)`` of the pieces, which symbolic tracing cannot iterate."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = list(self.cv1(self.stem(x)).chunk(2, 1))
        y.append(self.m(y[-1]))
        return self.cv2(torch.cat(y, 1))


@pytest.mark.slow  # one torch.export: 3-9 s on a loaded 2-core machine
def test_the_export_fallback_says_at_quantize_time_that_image_sizes_are_fixed():
    """F1: capture="auto" fell back to torch.export without a word, and the detector quantized at
    16x16 refused its first call at 24x24."""
    torch.manual_seed(0)
    data = [torch.randn(1, 3, 16, 16) for _ in range(2)]
    with pytest.warns(UserWarning) as caught:
        int8 = qp.quantize(UltralyticsC2f(split=False).eval(), data[0], data, backend="reference")
    said = [str(w.message) for w in caught if "fixing image sizes" in str(w.message)]
    assert len(said) == 1
    assert "its forward does not trace symbolically" in said[0] and "'x' 16x16 only" in said[0]
    assert "dynamic_shapes=" in said[0] and "calibrate with each size" in said[0]
    with pytest.raises(qp.errors.InputMismatchError, match="captured with 16"):
        int8(torch.randn(1, 3, 24, 24))
