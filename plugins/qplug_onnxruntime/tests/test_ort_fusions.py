"""ORT graph fusions qplug's sessions leave out (``SessionSettings.disabled_optimizers``).

A residual add followed by LayerNorm (every transformer block) is what ORT's SkipLayerNormFusion
rewrites into ``SkipLayerNormalization``, a CPU kernel slower than the two ops it replaces
(bench/bench_ort_fusions.py). By default qplug's sessions keep Add + LayerNormalization; the
setting can turn the fusion back on, and the numbers are the same either way.
"""

from __future__ import annotations

import collections
import copy

import onnx
import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.plugin_api import ConfigValidationError

from qplug_onnxruntime import SessionSettings, settings
from qplug_onnxruntime.session import SLOW_FUSIONS, OrtPartition


class ResidualNorm(nn.Module):
    """linear -> residual add -> LayerNorm: the tail of a transformer block."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 32)
        self.norm = nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.linear(x))


@pytest.fixture(scope="module")
def block():
    model = ResidualNorm().eval()
    g = torch.Generator().manual_seed(0)
    calibration = [(torch.randn(2, 8, 32, generator=g),) for _ in range(2)]
    qmodel = qp.quantize(model, calibration[0], calibration, backend="onnxruntime", recipe="none")
    (partition,) = [m for m in qmodel.modules() if isinstance(m, OrtPartition)]
    return qmodel, partition, calibration[0]


def _optimized_ops(session_settings: SessionSettings, source: bytes, tmp_path) -> collections.Counter:
    path = tmp_path / "optimized.onnx"
    session_settings.inference_session(source, optimized_model_filepath=str(path))
    return collections.Counter(node.op_type for node in onnx.load(str(path)).graph.node)


def test_skip_layer_norm_fusion_is_left_out_by_default(block, tmp_path):
    _, partition, _ = block
    assert "SkipLayerNormFusion" in settings().disabled_optimizers == SLOW_FUSIONS
    source = partition.sources[0]
    default = _optimized_ops(SessionSettings(num_threads=1), source, tmp_path)
    fused = _optimized_ops(SessionSettings(num_threads=1, disabled_optimizers=()), source, tmp_path)
    assert default["SkipLayerNormalization"] == 0 and default["LayerNormalization"] == 1
    assert fused["SkipLayerNormalization"] == 1  # the setting is what keeps ORT from fusing it


def test_outputs_are_the_same_with_and_without_the_fusion(block):
    qmodel, partition, x = block
    with torch.no_grad():
        unfused = qmodel(*x).clone()
        clone = copy.deepcopy(qmodel)
        (fused_partition,) = [m for m in clone.modules() if isinstance(m, OrtPartition)]
        fused_partition.rebuild(SessionSettings(num_threads=1, disabled_optimizers=()))
        fused = clone(*x)
    assert fused_partition.session_settings.disabled_optimizers == ()
    torch.testing.assert_close(unfused, fused, rtol=0, atol=1e-5)


def test_disabled_optimizers_must_be_a_tuple_of_names():
    with pytest.raises(ConfigValidationError, match="disabled_optimizers must be a tuple"):
        SessionSettings(disabled_optimizers=["SkipLayerNormFusion"])  # type: ignore[arg-type]
