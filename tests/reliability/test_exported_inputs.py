"""How converted and calibrating models take their inputs (an outside tester's reports, session 21):
a calibration batch whose mask changed kind and an argument that was None when torch.export
captured the model each get qplug's error naming the input, also after qp.load. (A misspelt or
missing input: tests/regressions/test_builtin_blocks_calls.py, beside the delegated models' case.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import InputMismatchError

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


class MaskedHead(nn.Module):
    """Two linears with a padding mask between them."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)).masked_fill(mask.unsqueeze(-1), 0.0))


class OptionallyMaskedHead(MaskedHead):
    """``mask=None`` masks nothing."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) if mask is None else super().forward(x, mask)


def _inputs(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return [(torch.randn(2, 8, 16), torch.rand(2, 8) > 0.7) for _ in range(count)]


def _model(kind: type[MaskedHead] = MaskedHead) -> nn.Module:
    torch.manual_seed(0)
    return kind().eval()


@pytest.mark.parametrize("capture", ["symbolic", "export"])
@pytest.mark.parametrize("backend", ["fbgemm", "onnxruntime"])
def test_a_calibration_batch_with_a_float_mask_is_refused_before_the_graph_runs(backend, capture, capfd):
    """A float mask in a calibration batch where a bool one was captured printed torch's FX
    traceback ("Call using an FX-traced Module ... generated forward function") to stderr before
    qplug's error. Calibration now checks each input's kind before running a batch, as the
    converted model does: qplug's error names the batch and the input, and stderr stays clean."""
    batches = _inputs(3)
    x, mask = batches[1]
    batches[1] = (x, mask.float())
    capfd.readouterr()
    with pytest.raises(InputMismatchError, match=r"calibration batch 1: input 'mask' is float32 where the int8 "
                                                 r"model was captured with bool.*Pass mask as bool"):
        qp.quantize(_model(), batches[0], batches, backend=backend, capture=capture)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "generated forward" not in err, err


@pytest.mark.parametrize("backend", ["fbgemm", "onnxruntime"])
def test_a_tensor_where_export_captured_none_is_refused(backend, tmp_path):
    """Captured by torch.export with ``mask=None``, the model ignored every mask it was given later
    (0.435 from the masked float output, equal to the unmasked one): export builds a None argument
    into the graph. A tensor there is now refused saying so, at the call (also after qp.load) and in
    calibration; None still runs, as the unmasked float model."""
    float_model = _model(OptionallyMaskedHead)
    batches = _inputs(3)
    x, mask = batches[1]
    int8 = qp.quantize(float_model, (x, None), [(b, None) for b, _ in batches], backend=backend,
                       capture="export")
    loaded = qp.load(qp.save(int8, tmp_path / "m.safetensors"))
    none_at_capture = (r"input 'mask' is a tensor shaped \(2, 8\), but it was None when the model was captured "
                       r"\(torch.export\).*Quantize with an example \(and calibration batches\) that pass 'mask' set")
    with torch.no_grad():
        unmasked = float_model(x)
        for model in (int8, loaded):
            for call in (lambda m: m(x, mask), lambda m: m(x, mask=mask)):
                with pytest.raises(InputMismatchError, match=none_at_capture):
                    call(model)
            assert (model(x, None) - unmasked).abs().max() < 0.05
    with pytest.raises(InputMismatchError, match="calibration batch 1: " + none_at_capture):
        qp.quantize(float_model, (x, None), [(x, None), (x, mask)], backend=backend, capture="export")


def test_none_where_export_captured_a_tensor_is_refused():
    """The other way round: a model exported with a mask refuses a call with None there."""
    batches = _inputs(2)
    int8 = qp.quantize(_model(OptionallyMaskedHead), batches[0], batches, backend="fbgemm", capture="export")
    with pytest.raises(InputMismatchError, match=r"input 'mask' is None \(NoneType\); the model was captured "
                                                 r"\(torch.export\) with a tensor there"):
        int8(batches[1][0], None)


@pytest.mark.parametrize("backend", ["fbgemm", "onnxruntime"])
def test_none_where_tracing_captured_a_tensor_is_refused(backend, capfd):
    """Symbolic tracing with a mask keeps the masked branch, and the generated forward keeps the
    ``mask=None`` default: ``int8(x)`` or ``int8(x, None)`` failed inside the graph with
    "AttributeError: 'NoneType' object has no attribute 'unsqueeze'" and an FX traceback. It is
    refused naming the input, in calibration too."""
    batches = _inputs(3)
    int8 = qp.quantize(_model(OptionallyMaskedHead), batches[0], batches, backend=backend, capture="symbolic")
    x, mask = batches[1]
    expected = r"input 'mask' is None \(or left out\), but the model was captured with a bool tensor there"
    capfd.readouterr()
    for call in (lambda: int8(x), lambda: int8(x, None), lambda: int8(x, mask=None)):
        with pytest.raises(InputMismatchError, match=expected):
            call()
    with pytest.raises(InputMismatchError, match=rf"calibration batch 1: {expected}"):
        qp.quantize(_model(OptionallyMaskedHead), batches[0], [batches[0], (x, None)], backend=backend,
                    capture="symbolic")
    assert "Traceback" not in capfd.readouterr().err
    assert torch.equal(int8(x, mask), int8(x, mask=mask))


def test_an_image_of_another_size_is_refused_naming_qplugs_choice_and_the_remedies():
    """A plain conv net reads no size, yet the error said its sizes were fixed "because the model's
    code reads them": export capture fixes an image's height and width on purpose (ir/capture.py)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1)).eval()
    images = [(torch.randn(2, 3, 32, 32),) for _ in range(4)]
    int8 = qp.quantize(model, images[0], images, backend="fbgemm", capture="export")
    assert int8(torch.randn(5, 3, 32, 32)).shape == (5, 4, 32, 32)  # the batch stays dynamic
    with pytest.raises(InputMismatchError, match=r"size 48 at dim 2 \(captured with 32\), size 40 at dim 3 .*"
                                                 r"qplug's export capture keeps an image's height and width at "
                                                 r"the example's .* capture='symbolic' .* pass the ExportedProgram"):
        int8(torch.randn(1, 3, 48, 40))
