"""Defects an outside tester found calling int8 models built from PyTorch's own blocks (2026-12-06):
each test is that user's own call, with the numbers or the error they rely on."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qplug_core as qp
from qplug_core.errors import InputMismatchError
from qplug_core.partition.compiled import CompiledPartition

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


class Upsampler(nn.Module):
    """A conv, an upsampling, a conv: the decoder step of super-resolution and volumetric models."""

    def __init__(self, dims: int, upsample: nn.Module) -> None:
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
        self.c1, self.up, self.c2 = conv(3, 8, 3, padding=1), upsample, conv(8, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(self.up(torch.relu(self.c1(x))))


class Interpolate(nn.Module):
    def __init__(self, **options) -> None:
        super().__init__()
        self.options = options

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x, **self.options)


#: case -> (dimensions, the upsampling, its name in the report)
_UPSAMPLINGS = {
    "bicubic": (2, Interpolate(scale_factor=2, mode="bicubic"), "interpolate"),
    "bilinear-antialias": (2, Interpolate(scale_factor=0.5, mode="bilinear", antialias=True), "interpolate"),
    "Upsample-trilinear": (3, nn.Upsample(scale_factor=2, mode="trilinear"), "up"),
    "Upsample-nearest-1d": (1, nn.Upsample(scale_factor=2, mode="nearest"), "up"),
    "nearest-1d": (1, Interpolate(scale_factor=2, mode="nearest"), "interpolate"),
}


@pytest.mark.parametrize("backend", ["fbgemm", "qnnpack"])
@pytest.mark.parametrize("case", list(_UPSAMPLINGS))
def test_an_upsampling_without_a_quantized_kernel_keeps_the_reference_form(case, backend):
    """qp.quantize returned a model whose every call raised torch's NotImplementedError ("Could not
    run 'aten::upsample_bicubic2d.out' with arguments from the 'QuantizedCPU' backend"): the
    upsampling was lowered whatever its mode. Now it runs in float between a dequantize and a
    quantize, with a warning and the reason in the report, and answers as the reference form. A 1-d
    nearest is refused by its example input's rank (its warning blamed the plugin: "kernel
    passthrough of plugin 'fbgemm' ... broke the kernel contract ... raised NotImplementedError")."""
    dims, upsample, name = _UPSAMPLINGS[case]
    torch.manual_seed(0)
    model = Upsampler(dims, upsample).eval()
    shape = (2, 3, *(6,) * dims)
    batches = [torch.randn(shape) for _ in range(3)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        int8 = qp.quantize(model, batches[0], batches, backend=backend)
    reference = qp.quantize(model, batches[0], batches, backend="reference")
    report = qp.quantization_report(int8)
    assert name not in report.kernels and report.kernels["c1"].startswith("quantized::conv")
    why = report.reference[name]
    assert any(f"node {name!r}" in str(w.message) and why.split(";")[0] in str(w.message) for w in caught)
    assert why.startswith("kernel passthrough refused this region: upsampling mode") and \
        "has no int8 kernel in torch" in why
    if dims == 1:
        assert "mode 'nearest' in 1-d (a 3-d input)" in why
    x = torch.randn(shape)
    with torch.no_grad():
        if backend == "fbgemm":
            assert torch.equal(int8(x), reference(x))
        else:  # qnnpack's convs round otherwise (36.2-39.3 dB here; 37.3 dB with a lowered nearest)
            assert qp.sqnr(reference(x), int8(x)) > 33


@pytest.mark.parametrize("mode", ["nearest", "nearest-exact", "bilinear", "area"])
def test_an_upsampling_with_a_quantized_kernel_still_runs_it(mode):
    """The modes torch's quantized tensors take stay lowered (no dequantize/quantize pair), and the
    kernel contract's run at convert accepts them (bilinear rounds otherwise: 43.9 dB)."""
    torch.manual_seed(0)
    model = Upsampler(2, nn.Upsample(scale_factor=2, mode=mode)).eval()
    batches = [torch.randn(2, 3, 6, 6) for _ in range(3)]
    int8 = qp.quantize(model, batches[0], batches, backend="fbgemm")
    reference = qp.quantize(model, batches[0], batches, backend="reference")
    assert qp.quantization_report(int8).kernels["up"] == "passthrough"
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        assert qp.sqnr(reference(x), int8(x)) > 40


class MaskedHead(nn.Module):
    """Two linears and a padding mask, called as attention code calls its models: ``q(x, mask=m)``."""

    def __init__(self, bool_mask: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.bool_mask = bool_mask

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        h = h.masked_fill(mask.unsqueeze(-1), 0.0) if self.bool_mask else h * mask.unsqueeze(-1)
        return self.b(h)


def _masked_head(backend: str, bool_mask: bool = False, capture: str = "auto"):
    torch.manual_seed(0)
    mask = torch.zeros(2, 5, dtype=torch.bool) if bool_mask else torch.ones(2, 5)
    mask[0, -2:] = 1 - mask[0, -2:].float()
    batches = [(torch.randn(2, 5, 8), mask) for _ in range(3)]
    int8 = qp.quantize(MaskedHead(bool_mask).eval(), batches[0], batches, backend=backend, capture=capture)
    return int8, batches[0]


@pytest.mark.parametrize("capture", ["symbolic", "export"])
@pytest.mark.parametrize("backend", ["onnxruntime", "openvino", "fbgemm", "qnnpack", "reference"])
def test_a_converted_model_takes_its_inputs_by_name(backend, capture, tmp_path):
    """``q(x, mask=m)`` raised "TypeError: SolePartitionForward.__call__() got an unexpected keyword
    argument 'mask'" on onnxruntime and openvino (fbgemm took it), also after qp.load. Now the
    inputs bind by name as the float model's forward does, and a call that does not fit is a qplug
    error naming the inputs. fbgemm, qnnpack and reference models met a misspelt or missing input
    with Python's "forward() got an unexpected keyword argument 'msk'" (session 21): they now give
    the same error, from the same check."""
    int8, (x, mask) = _masked_head(backend, capture=capture)
    loaded = qp.load(qp.save(int8, tmp_path / "m.safetensors"))
    for model in (int8, loaded):
        with torch.no_grad():
            want = model(x, mask)
            assert torch.equal(model(x, mask=mask), want) and torch.equal(model(mask=mask, x=x), want)
        with pytest.raises(InputMismatchError, match=r"no input named 'msk' \(did you mean 'mask' "
                                                               r"for 'msk'\?\); it takes the inputs \(x, mask\)"):
            model(x, msk=mask)
        with pytest.raises(InputMismatchError, match=r"called with input\(s\) 'mask' missing"):
            model(x)
        with pytest.raises(InputMismatchError, match=r"input\(s\) 'x' given both by position and by name"):
            model(x, mask, x=x)


@pytest.mark.parametrize("backend", ["fbgemm", "onnxruntime"])
def test_a_mask_of_another_dtype_than_at_capture_is_refused_naming_it(backend, tmp_path):
    """A padding mask quantized as bool and passed as float raised torch's "masked_fill_ only supports
    boolean masks" from inside the graph on fbgemm, and on onnxruntime an InputMismatchError saying
    the (identical) shapes were wrong. Now every backend refuses the call before running anything,
    naming the input and both dtypes, also after qp.load."""
    int8, (x, mask) = _masked_head(backend, bool_mask=True)
    loaded = qp.load(qp.save(int8, tmp_path / "m.safetensors"))
    for model in (int8, loaded):
        for call in (lambda m: m(x, mask.float()), lambda m: m(x, mask=mask.long())):
            with pytest.raises(InputMismatchError, match=r"input 'mask' is (float32|int64) where the "
                                                                   r"int8 model was captured with bool"):
                call(model)
        with pytest.raises(InputMismatchError, match=r"input 'x' is int64 where the int8 model was "
                                                               r"captured with float32"):
            model(x.long(), mask)
        with torch.no_grad():  # the dtypes it was quantized with still run
            assert torch.equal(model(x, mask=mask), int8(x, mask))


def test_a_compiled_partition_says_the_dtypes_differ_when_the_shapes_do_not():
    """Past the model's own check (a partition called directly), onnxruntime's partition turned any
    error of its ops into "cannot take inputs of shape (2, 5, 8), (2, 5): the model's inputs do not
    have the shape it was quantized for", the shapes being those it was compiled for."""
    int8, (x, mask) = _masked_head("onnxruntime", bool_mask=True)
    partition = next(m for m in int8.modules() if isinstance(m, CompiledPartition))
    with pytest.raises(InputMismatchError, match=r"cannot take inputs of dtype float32, float32 where "
                                                           r"it was compiled for float32, bool \(the shapes are "
                                                           r"the same\)"):
        partition(x, mask.float())
