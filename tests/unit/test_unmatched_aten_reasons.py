"""An ATen op no pattern matched: the report says whether the backend has a pattern for it at all.

Wav2Vec2's report blamed the export for ``gelu`` and ``scaled_dot_product_attention`` ("an ATen
op from torch.export that qplug does not map"), though no backend has a pattern for them at either
capture level; only an op whose module or functional form a pattern names (``F.group_norm``,
``F.interpolate``) is one qplug does not map.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import qplug_core as qp
from qplug_core.config.defaults import FLOAT_IN_STATIC_REASON
from qplug_core.flows.report import NO_PATTERN, UNMAPPED_ATEN, no_pattern_reason, pattern_op_keys
from qplug_core.registry.backends import get_backend

aten = torch.ops.aten


@pytest.mark.parametrize("op, args, reason", [
    (aten.gelu.default, (), NO_PATTERN),
    (aten.scaled_dot_product_attention.default, (), NO_PATTERN),
    (aten.group_norm.default, (2,), UNMAPPED_ATEN),  # F.group_norm is a pattern
    (aten.upsample_bicubic2d.vec, ([4, 4], False, None), UNMAPPED_ATEN),  # F.interpolate is one
    (aten.bmm.default, (), UNMAPPED_ATEN),  # torch.matmul is one
])
def test_an_unmatched_aten_op_is_blamed_on_the_mapping_only_where_a_pattern_names_its_form(
        op, args, reason, plugin_autoload):
    graph = fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(op, (x, *args))
    assert no_pattern_reason(node, pattern_op_keys(get_backend("fbgemm").config)) == reason
    assert no_pattern_reason(node) == NO_PATTERN  # backend unknown: only what is sure


class ConvNormsGelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 3)
        self.group_norm = nn.GroupNorm(2, 8)
        self.instance_norm = nn.InstanceNorm1d(8, affine=True)
        self.out = nn.Conv1d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.instance_norm(self.group_norm(self.conv(x)))))


@pytest.mark.slow  # an export: 3-11 s on the shared 2-core machine
def test_the_report_of_an_exported_model_says_which_float_ops_no_pattern_names(plugin_autoload):
    torch.manual_seed(0)
    data = [(torch.randn(2, 4, 16),) for _ in range(3)]
    int8 = qp.quantize(ConvNormsGelu().eval(), data[0], data, backend="fbgemm", capture="export",
                       progress=False)
    reasons = {entry.op: entry.reason for entry in qp.quantization_report(int8).skipped}
    # aten.group_norm is raised to the GroupNorm module: the documented reason, as under symbolic capture
    assert reasons == {"gelu.default": NO_PATTERN, "instance_norm.default": UNMAPPED_ATEN,
                       "GroupNorm": FLOAT_IN_STATIC_REASON}
