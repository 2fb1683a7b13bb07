"""A static linear on a 3-D input runs as one MatMulIntegerToFloat with its bias (``bias.py``):
no float Add over its output after the int8 matmul, and the same numbers as the reference form."""

from __future__ import annotations

import collections
import warnings

import onnx
import torch
from torch import nn

import qplug_core as qp
from qplug_core.plugin_api import Quantize

from qplug_onnxruntime.session import OrtPartition


class FeedForward(nn.Module):
    """A transformer's FFN on ``[batch, tokens, features]``: linear -> GELU -> linear -> residual."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


def _quantized(shape: tuple[int, ...]):
    torch.manual_seed(0)
    model = FeedForward().eval()
    g = torch.Generator().manual_seed(0)
    calibration = [(torch.randn(*shape, generator=g),) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a partition disagreeing with its reference form warns
        qmodel = qp.quantize(model, calibration[0], calibration, backend="onnxruntime", recipe="none")
    (partition,) = [m for m in qmodel.modules() if isinstance(m, OrtPartition)]
    return model, qmodel, partition, torch.randn(*shape, generator=g)


def _optimized_ops(partition: OrtPartition, tmp_path) -> collections.Counter:
    path = tmp_path / "optimized.onnx"
    partition.session_settings.inference_session(partition.sources[0], optimized_model_filepath=str(path))
    return collections.Counter(node.op_type for node in onnx.load(str(path)).graph.node)


def test_the_bias_of_a_linear_on_tokens_is_inside_the_int8_matmul(tmp_path):
    model, qmodel, partition, x = _quantized((2, 8, 32))
    ops = _optimized_ops(partition, tmp_path)
    # before: MatMulIntegerToFloat + BiasGelu for `up`, MatMulIntegerToFloat + Add for `down`
    assert ops["MatMulIntegerToFloat"] == 2 and ops["Add"] == 1 and ops["Gelu"] == 1
    assert ops["BiasGelu"] == 0
    assert not qp.quantization_report(qmodel).reference
    with torch.no_grad():
        got, want = qmodel(x), partition.partition(x)
    # the reference form's numbers, but for rounding: the session's int8 matmul and GELU differ
    # from the reference form's float ones in the last bits, so a GELU output on a rounding
    # boundary can land one code of `down`'s input grid away (with 7-bit weights, as a CPU
    # without VNNI gets them, one of 512 values' token row did), moving `down`'s outputs by one
    # step times a weight at most; a misplaced bias would be off by the bias (~0.1)
    (step,) = [float(m.qparams.scale) for m in partition.partition.modules() if isinstance(m, Quantize)][1:]
    torch.testing.assert_close(got, want, rtol=0, atol=1.05 * step * float(model.down.weight.abs().max()))
    with torch.no_grad():
        assert qp.sqnr(model(x), got) > 30.0


def test_a_linear_on_rows_stays_a_gemm_with_its_bias(tmp_path):
    _, _, partition, _ = _quantized((16, 32))
    ops = _optimized_ops(partition, tmp_path)
    assert ops["QGemm"] == 2 and ops["MatMulIntegerToFloat"] == 0 and ops["Add"] == 1
