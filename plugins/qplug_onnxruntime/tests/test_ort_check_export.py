"""A partition of several int8 regions whose outputs drift past one kernel's contract is checked
region by region; that check graph's ONNX model is cut from the partition's own, so convert
exports the partition once. Exporting the check graph too was the larger part of an FPN
detector's convert (104 of 152 s of its partition's compile and check)."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
import torch
from torch import nn

import qplug_core as qp

SDK = '''
from qplug_core.flows.tags import CHECK_REGIONS
from qplug_core.plugin_api import BackendSpec, Delegate, DTypeConfigSet, default_qconfig_mapping, hookimpl

from qplug_onnxruntime.session import OrtPartition, settings
from qplug_onnxruntime.support import OrtSupport, partition_to_onnx

COMPILED = []  # what each compile was asked for: "partition" or "check"


class Drifting(OrtPartition):
    """ONNX Runtime, the partition's output 3 steps off on every 20th element: drift past one
    kernel's contract, within a partition's, so its regions are checked one by one."""

    def run(self, compiled, inputs):
        outputs = super().run(compiled, inputs)
        if CHECK_REGIONS in self.partition.meta:
            return outputs
        out = outputs[0].clone()
        step = float(out.max() - out.min()) / 255
        out.view(-1)[::20] += 3 * step
        return [out, *outputs[1:]]


def compile_partition(partition, example_inputs):
    COMPILED.append("check" if CHECK_REGIONS in partition.meta else "partition")
    return Drifting(partition, example_inputs, partition_to_onnx, settings())


@hookimpl
def qplug_register_backends():
    return [BackendSpec("driftort", "ONNX Runtime whose partitions drift", float_outputs={"linear"})]


@hookimpl
def qplug_backend_pattern_configs(backend):
    return DTypeConfigSet.native().pattern_configs() if backend == "driftort" else []


@hookimpl
def qplug_default_qconfig_mapping(backend, mode):
    return default_qconfig_mapping(mode, per_channel=True) if backend == "driftort" else None


@hookimpl
def qplug_delegate(backend):
    return Delegate(operator_support=OrtSupport(), compile=compile_partition) if backend == "driftort" else None
'''


@pytest.fixture
def drifting(fake_dist):
    return fake_dist("qplug-driftort", SDK)


#: (model factory, input shape): the weights are drawn under the test's seed, not at import (an
#: unseeded draw made the float-output case fail its bound after some test orders)
CONVS = (lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 1)),
         (2, 3, 10, 10))
#: on 3-D input (batch x tokens) the first linear's output stays float (GELU reads it): a region
#: ending in a weighted op's float output inside the partition (BERT's FFN on onnxruntime)
FLOAT_OUTPUT = (lambda: nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)), (2, 5, 16))


def _observed(make: Callable[[], nn.Module], shape: tuple[int, ...]
              ) -> tuple[torch.fx.GraphModule, list[tuple[torch.Tensor]]]:
    torch.manual_seed(0)
    model = make().eval()
    data = [(torch.randn(shape),) for _ in range(2)]
    return qp.calibrate(qp.prepare_fx(model, None, data[0], backend="driftort"), data), data


@pytest.mark.parametrize("case", [CONVS, FLOAT_OUTPUT], ids=["convs", "float_output"])
def test_a_partition_checked_region_by_region_is_exported_once(drifting, monkeypatch, case):
    exports = []
    export = torch.onnx.export
    monkeypatch.setattr(torch.onnx, "export", lambda *args, **kwargs: exports.append(1) or export(*args, **kwargs))
    observed, data = _observed(*case)
    reference = qp.convert_to_reference_fx(observed)
    lowered = qp.convert_fx(observed)
    sdk = sys.modules["qplug_driftort"]
    assert sdk.COMPILED == ["partition", "check"]  # its regions were checked one by one ...
    assert len(exports) == 1  # ... on a model cut from the partition's
    assert [p["module"] for p in qp.quantization_report(lowered).partitions] == ["Drifting"]
    with torch.no_grad():
        expected, got = reference(*data[1]), lowered(*data[1])
    assert 0 < float((got - expected).abs().max()) <= 3.01 * float(expected.max() - expected.min()) / 255
