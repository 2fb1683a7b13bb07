"""Defects a user quantizing speech and sequence models found (s19/audio): each test is that user's
own call, with the numbers or the error they rely on."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import InputMismatchError
from qplug_core.flows import float_reference

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")

#: what qp.quantize, qp.compare and the CLI's accuracy say once about the encoder's fast path
PADDED_ROWS_NOTE = "returns zeros at the padded positions"


class MaskedEncoder(nn.Module):
    """Features -> nn.TransformerEncoder with a bool padding mask -> head (the report's model)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(20, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.proj(x), src_key_padding_mask=mask))


def padded_batch(batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Features and a padding mask whose first sequence is half padding."""
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[0, length // 2:] = True
    return torch.randn(batch, length, 20), mask


@pytest.fixture(scope="module")
def masked_encoder():
    """The report's model quantized at length 12; qp.quantize says once that the float encoder
    zeroes padded positions (the note is said once per process: forgotten before and after)."""
    torch.manual_seed(0)
    model = MaskedEncoder().eval()
    data = [padded_batch(2, 12) for _ in range(4)]
    float_reference._note_once.cache_clear()
    with pytest.warns(UserWarning, match=PADDED_ROWS_NOTE):
        int8 = qp.quantize(model, data[0], data, backend="fbgemm")
    assert qp.quantization_report(int8).capture == "export"
    yield model, int8, data
    float_reference._note_once.cache_clear()


def float_as_exported(model: nn.Module, *inputs: torch.Tensor) -> torch.Tensor:
    """The float model on torch's ordinary path, which computes padded positions like the others."""
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad():
            return model(*inputs)
    finally:
        torch.backends.mha.set_fastpath_enabled(True)


@pytest.mark.parametrize("batch, length", [(2, 20), (1, 7)])
def test_an_encoder_quantized_at_one_length_runs_at_others(masked_encoder, batch, length):
    """Calibrated at length 12, any other length failed deep in the graph with torch's raw
    "RuntimeError: shape '[12, 8, 8]' is invalid for input of size ...": the mask's length was
    exported dynamic, the features' fixed, and no guard caught the mismatch at the call."""
    model, int8, _ = masked_encoder
    x, mask = padded_batch(batch, length)
    with torch.no_grad():
        got = int8(x, mask)
    assert qp.sqnr(float_as_exported(model, x, mask), got) > 18  # 22 dB (1 x 7), 29 dB (2 x 20) measured


class FixedLength(nn.Module):
    """Reads its whole 30-step sequence into one Linear: export fixes the length."""

    def __init__(self) -> None:
        super().__init__()
        self.frame = nn.Linear(16, 16)
        self.head = nn.Linear(30 * 16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.frame(x).reshape(x.shape[0], 30 * 16))


def test_a_length_the_capture_fixed_is_refused_at_the_call_naming_it():
    """docs/guide/static-ptq.md promises InputMismatchError for an input of another shape; the
    converted model lost torch.export's guard and failed inside (or, where the guard survived,
    raised torch's RuntimeError "Expected input at *args[0].shape[1] to be equal to 30")."""
    torch.manual_seed(0)
    model = FixedLength().eval()
    data = [(torch.randn(2, 30, 16),) for _ in range(4)]
    int8 = qp.quantize(model, data[0], data, backend="fbgemm", capture="export")
    with torch.no_grad():
        assert qp.sqnr(model(torch.randn(3, 30, 16)), int8(torch.randn(3, 30, 16))) < float("inf")
        with pytest.raises(InputMismatchError, match=r"input 'x' has size 45 at dim 1 \(captured with 30\)"):
            int8(torch.randn(2, 45, 16))


@pytest.mark.parametrize("reference", ["float", "fused"])
def test_compare_on_an_encoder_with_a_padding_mask_compares_like_with_like(masked_encoder, reference):
    """qp.compare crashed with torch's "Internal error: NestedTensorImpl doesn't support sizes"
    (the float encoder's fast path passes NestedTensors between its layers), and a whole-output
    SQNR read 4.8 dB for a model at 42.7 dB on its real rows (the fast path zeroes padded rows,
    the int8 model computes them). The user's torch setting is left as it was."""
    model, int8, data = masked_encoder
    float_model = model if reference == "float" else qp.fuse_fx(model, backend="fbgemm")  # the README's form
    report = qp.compare(float_model, int8, data)
    assert report.output_sqnr_db > 25  # 35 dB measured (3.8 dB against the fast path's zeros)
    assert {"enc.layers.0.linear1", "head"} <= {layer.name for layer in report.layers}
    assert torch.backends.mha.get_fastpath_enabled()


def test_compare_notes_the_zeroed_padded_rows_once(masked_encoder):
    """The user's own float model (fast path on) still zeroes the padded rows: qp.compare says so
    the first time it sees the encoder called with a mask, and not on every call after."""
    model, int8, data = masked_encoder
    float_reference._note_once.cache_clear()
    with pytest.warns(UserWarning, match=PADDED_ROWS_NOTE):
        qp.compare(model, int8, data[:1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qp.compare(model, int8, data[:1])
