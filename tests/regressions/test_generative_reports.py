"""Defects a generative-model user found (2026-12-06, a diffusion UNet ``forward(x, t, ctx)``
captured by torch.export): each test is that user's own call, with the numbers or the error they
rely on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import InputMismatchError

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


class TimestepNet(nn.Module):
    """A UNet block in small: a conv on ``x`` plus an embedding of the timestep, which may be an
    int64 ``[B]`` or ``[1]`` tensor, a 0-d tensor or a Python int (diffusers takes all four).
    The output's batch is read from ``t`` once it is broadcast, as the UNet's attention reshape did."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.emb = nn.Conv1d(4, 8, 1), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, t) -> torch.Tensor:
        if not torch.is_tensor(t):
            t = torch.tensor([t])
        t = t.reshape(-1).expand(x.shape[0])
        angles = t[:, None].float() * torch.arange(1, 5, dtype=torch.float32) / 1000
        embedding = self.emb(torch.cat([angles.sin(), angles.cos()], dim=1))
        return (self.conv(x) + embedding[:, :, None]).reshape(t.shape[0], -1)


def _quantized(timesteps: list, backend: str = "fbgemm") -> tuple[nn.Module, nn.Module, torch.Tensor]:
    """The float model, its int8 form calibrated with a batch per timestep, and a held-out ``x``."""
    torch.manual_seed(0)
    model = TimestepNet().eval()
    batches = [(torch.randn(2, 4, 16), t) for t in timesteps]
    x = torch.randn(2, 4, 16)
    return model, qp.quantize(model, batches[0], batches, backend=backend, capture="export"), x


def _tensor_timesteps() -> list[torch.Tensor]:
    return [torch.tensor([t, 999 - t]) for t in range(0, 1000, 111)]


def test_a_timestep_given_as_an_int_is_refused_at_another_value(tmp_path):
    """torch.export built the example's ``t=999`` into the graph: the int8 model answered for 999
    at every t, silently (here t=500: bit-identical to t=999, 5.2 dB against float at t=500), also
    after qp.load. Now the example's value runs as before and another value raises, naming the
    input, the value built in and the fix."""
    model, int8, x = _quantized([999] * 8)
    with torch.no_grad():
        assert qp.sqnr(model(x, 999), int8(x, 999)) > 30  # 42.1 dB measured
    path = tmp_path / "timestep.qplug"
    qp.save(int8, path)
    for candidate in (int8, qp.load(path)):
        with pytest.raises(InputMismatchError, match=r"input 't' is 500 \(int\), but the model was captured "
                                                     r"\(torch.export\) with its example's value 999 built in"
                                                     r".*torch.tensor\(\[t\]\)"):
            candidate(x, 500)
        with pytest.raises(InputMismatchError, match="input 't' is a tensor shaped"):
            candidate(x, torch.tensor([999, 999]))


def test_calibration_batches_with_another_int_timestep_are_refused():
    """Eight calibration batches with t from 999 down to 0 all calibrated the example's constant
    t=999, silently. Now the first batch with another value is refused before it is observed."""
    model = TimestepNet().eval()
    torch.manual_seed(0)
    batches = [(torch.randn(2, 4, 16), t) for t in (999, 856, 713)]
    with pytest.raises(InputMismatchError, match=r"calibration batch 1: input 't' is 856 \(int\), but the model "
                                                 r"was captured \(torch.export\) with its example's value 999"):
        qp.quantize(model, batches[0], batches, backend="fbgemm", capture="export")


@pytest.mark.parametrize("backend", ["fbgemm", "onnxruntime", "openvino"])
def test_a_timestep_of_another_rank_is_one_qplug_error(backend):
    """Quantized with t of shape [B], a 0-d t failed in the graph with IndexError ("Dimension
    specified as 0 but tensor has no dimensions") and an int t with a RuntimeError from sym_size
    (onnxruntime, openvino: AttributeError "'int' object has no attribute 'shape'"). Now both are
    an InputMismatchError naming the input and the rank or the tensor it was captured with."""
    model, int8, x = _quantized(_tensor_timesteps(), backend)
    with torch.no_grad():
        t = torch.tensor([500, 10])
        assert qp.sqnr(model(x, t), int8(x, t)) > 30  # the captured form still runs: 40.7-44.6 dB
    with pytest.raises(InputMismatchError, match=r"input 't' has 0 dimension\(s\) \(\); the model was captured "
                                                 r"\(torch.export\) for 1 \(its example was \(2,\)\)"):
        int8(x, torch.tensor(500))
    with pytest.raises(InputMismatchError, match=r"input 't' is 500 \(int\); the model was captured "
                                                 r"\(torch.export\) with a tensor there"):
        int8(x, 500)


def test_sizes_export_traced_as_equal_must_be_equal(tmp_path):
    """``t.expand(x.shape[0])`` made export give t's and x's batch one symbol; a ``[1]`` t (which
    the float model broadcasts) then ran silently with the wrong batch: shape (1, 256) where float
    gives (2, 128) (the UNet's reshape failed with a RuntimeError printing generated code). Now it
    is refused naming both dims, also after qp.load; other batches keep running."""
    _, int8, _ = _quantized(_tensor_timesteps())
    path = tmp_path / "timestep.qplug"
    qp.save(int8, path)
    for candidate in (int8, qp.load(path)):
        with pytest.raises(InputMismatchError, match=r"input 'x' dim 0 is 2, input 't' dim 0 is 1, but these "
                                                     r"sizes must be equal"):
            candidate(torch.randn(2, 4, 16), torch.tensor([500]))
        assert candidate(torch.randn(3, 4, 16), torch.tensor([1, 2, 3])).shape == (3, 128)


class Scaled(nn.Module):
    """A conv whose output is scaled by a Python number: symbolic tracing keeps it an input."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 1)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.relu(self.conv(x)) * scale


def test_a_symbolically_traced_number_input_stays_an_input():
    """The checks above are export's: a symbolically traced model takes any value of a number
    input, and an unbatched input its float model takes."""
    torch.manual_seed(0)
    model = Scaled().eval()
    batches = [(torch.randn(2, 4, 16), 1.0) for _ in range(4)]
    int8 = qp.quantize(model, batches[0], batches, backend="fbgemm", recipe="none")
    assert qp.quantization_report(int8).capture == "symbolic"
    x = torch.randn(2, 4, 16)
    with torch.no_grad():
        assert torch.allclose(int8(x, 3.0), 3 * int8(x, 1.0))
        assert qp.sqnr(model(x[0], 1.0), int8(x[0], 1.0)) > 20  # 24.7 dB
