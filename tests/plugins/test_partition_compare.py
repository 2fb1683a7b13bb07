"""qp.compare on a delegated model measures the compiled partitions themselves: each one on the
inputs it receives, against its reference form and against its float form."""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
from torch import nn

import qplug_core as qp

SDK = '''
import torch
from torch import nn
from qplug_core.plugin_api import (BackendPlugin, Delegate, Dequantize, OperatorSupportBase,
                                   Quantize, ReferenceWeighted)

OFF_BY = {"steps": 0, "nan": False}


class Compiled(nn.Module):
    """Runs the partition, wrong by OFF_BY["steps"] (a faulty compiler): integer outputs moved
    that many steps, float ones scaled by 5% per step."""

    def __init__(self, partition):
        super().__init__()
        self.partition = partition

    def forward(self, *args):
        out, steps = self.partition(*args), OFF_BY["steps"]
        if OFF_BY["nan"]:
            return torch.full(out.shape, float("nan"))
        if out.is_floating_point():
            return out * (1 + 0.05 * steps)
        return (out.to(torch.int32) + steps).clamp(0, 255).to(out.dtype)


class TakesConvs(OperatorSupportBase):
    def is_node_supported(self, submodules, node):
        module = submodules.get(node.target) if node.op == "call_module" else None
        return isinstance(module, (Quantize, Dequantize, ReferenceWeighted))


class Sdk(BackendPlugin):
    name = "sdk"

    def delegate(self):
        return Delegate(operator_support=TakesConvs(),
                        compile=lambda partition, example_inputs: Compiled(partition))


plugin = Sdk()
'''


def _model_and_data():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.Sigmoid()).eval()
    data = [(torch.randn(2, 3, 8, 8),) for _ in range(3)]
    return model, data


def _partition_rows(report):
    return [layer for layer in report.layers if layer.name.startswith("delegate_")]


def test_each_partition_is_measured_against_its_reference_and_float_forms(fake_dist):
    fake_dist("qplug-sdk", SDK, module="qplug_sdk:plugin")
    __import__("qplug_sdk").OFF_BY.update(steps=0, nan=False)
    model, data = _model_and_data()
    qmodel = qp.quantize(model, data[0], data, backend="sdk")
    fused = qp.fuse_fx(model, data[0], backend="sdk")
    report = qp.compare(fused, qmodel, data)
    (row,) = _partition_rows(report)
    assert row.quant_type == "Compiled" and row.num_outputs == len(data)
    # the convs inside the partition do not run as themselves: no per-layer rows for them
    assert not {"0", "2"} & {layer.name for layer in report.layers}
    assert report.skipped["2"].startswith("inside compiled partition delegate_0")
    assert row.reference_sqnr_db == math.inf  # compiling changed nothing
    # against float: what int8 changed in the convs (the partition), seen independently as
    # the float convs against the reference model's output before its float sigmoid
    reference = qp.quantize(model, data[0], data, backend="reference")
    convs = nn.Sequential(fused.get_submodule("0"), fused.get_submodule("2"))
    want = torch.cat([convs(x) for (x,) in data])
    got = torch.cat([torch.logit(reference(x).double()) for (x,) in data])
    assert row.sqnr_db == pytest.approx(qp.sqnr(want.double(), got), abs=0.5)


def test_a_partition_compiled_wrong_keeps_the_reference_form_and_compare_says_so(fake_dist):
    """A compiler returning non-finite values breaks the contract at convert: the partition keeps
    its reference form (a warning names it and the plugin), so compare shows no compiled one."""
    fake_dist("qplug-sdk", SDK, module="qplug_sdk:plugin")
    __import__("qplug_sdk").OFF_BY.update(steps=0, nan=True)
    model, data = _model_and_data()
    with pytest.warns(UserWarning, match="partition delegate_0 compiled by plugin 'sdk'.*broke the "
                                         "kernel contract"):
        qmodel = qp.quantize(model, data[0], data, backend="sdk")
    assert any("broke the kernel contract" in why for why in qp.quantization_report(qmodel).reference.values())
    report = qp.compare(qp.fuse_fx(model, data[0], backend="sdk"), qmodel, data)
    assert all(row.quant_type != "Compiled" for row in _partition_rows(report))


def test_a_partition_the_float_model_does_not_fit_is_skipped_with_why(fake_dist):
    """A float model whose layer of the partition's name has another shape: the float form cannot
    be compared, and the report says so where the RuntimeError of torch's subtraction escaped."""
    fake_dist("qplug-sdk", SDK, module="qplug_sdk:plugin")
    __import__("qplug_sdk").OFF_BY.update(steps=0, nan=False)
    model, data = _model_and_data()
    qmodel = qp.quantize(model, data[0], data, backend="sdk")
    other = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 1), nn.Sigmoid(),
                          nn.AdaptiveAvgPool2d(4)).eval()  # "2" is a 1x1 conv: the output has the same shape
    report = qp.compare(other, qmodel, data)
    assert not _partition_rows(report)
    assert re.match(r"not measured: its reference or float form failed on the inputs it received \(RuntimeError: "
                    r".*\); the float form runs float_model's layers of the same names", report.skipped["delegate_0"])


def test_onnxruntime_partitions_are_compared(plugin_autoload):
    model, data = _model_and_data()
    qmodel = qp.quantize(model, data[0], data, backend="onnxruntime")
    fused = qp.fuse_fx(model, data[0], backend="onnxruntime")
    report = qp.compare(fused, qmodel, data)
    rows = _partition_rows(report)
    assert rows and all(row.reference_sqnr_db > 35 and row.sqnr_db > 25 for row in rows)
    assert "vs ref dB" in str(report) and "delegate_" in str(report)
    assert len(str(report)) < 2000 and "LayerComparison(" not in str(report)


def test_a_kernel_backend_gets_no_partition_rows(plugin_autoload):
    model, data = _model_and_data()
    qmodel = qp.quantize(model, data[0], data, backend="fbgemm")
    report = qp.compare(qp.fuse_fx(model, data[0], backend="fbgemm"), qmodel, data)
    assert not _partition_rows(report) and all(layer.reference_sqnr_db is None
                                               for layer in report.layers)


WRONG_AFTER_SEGMENT_MEAN = '''
import copy
from torch import nn
from qplug_core.plugin_api import BackendPlugin, Delegate, OperatorSupportBase, Quantize


class Compiled(nn.Module):
    def __init__(self, partition):
        super().__init__()
        self.partition = partition

    def forward(self, *args):
        return self.partition(*args)


def _compile(partition, example_inputs):
    """A compiler putting the output of a segment mean on another grid (1.5x its scale): wrong
    in that region only, so convert's region check blames it and plans the partition again."""
    partition = copy.deepcopy(partition)
    for node in partition.graph.nodes:
        module = partition.get_submodule(node.target) if node.op == "call_module" else None
        if isinstance(module, Quantize) and getattr(node.args[0], "target", None) == "scatter_reduce":
            module.scale *= 1.5
    return Compiled(partition)


class TakesAllButSigmoid(OperatorSupportBase):
    def is_node_supported(self, submodules, node):
        return "sigmoid" not in str(node.target)


class Sdk(BackendPlugin):
    name = "sdk"

    def delegate(self):
        return Delegate(operator_support=TakesAllButSigmoid(), compile=_compile)


plugin = Sdk()
'''


class SegmentMean(nn.Module):
    """Linear, a segment mean over graph nodes (a GNN readout), Linear; a float sigmoid the SDK
    does not take; Linear: two partitions, the first of which breaks the contract at convert."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(4, 4)

    def forward(self, x, batch):
        h = torch.relu(self.a(x))
        pooled = torch.zeros(3, 8).scatter_reduce(0, batch.unsqueeze(-1).expand_as(h), h, reduce="mean",
                                                  include_self=False)
        return self.c(torch.sigmoid(self.b(pooled)))


def _graph_batches():
    torch.manual_seed(0)
    model = SegmentMean().eval()
    segments = [torch.sort(torch.cat([torch.arange(3), torch.randint(0, 3, (17,))])).values for _ in range(4)]
    return model, [(torch.randn(20, 8), batch) for batch in segments]


def test_a_region_that_breaks_the_contract_stays_out_and_every_partition_around_it_is_compared(fake_dist, tmp_path):
    """The segment-mean region (float ops no pattern tags, ending in the quantize before ``b``) broke
    the contract: convert refused only its tagged ``unsqueeze``, planned the same partition again
    and kept it whole in reference form, so ``a`` and ``b`` ran in PyTorch despite the warning
    "the rest of the partition compiled without it"; and compare, pairing partitions by name,
    raised torch's RuntimeError from ``expand``. Now the region alone stays in PyTorch and compare
    measures each compiled partition against exactly what convert compiled."""
    fake_dist("qplug-sdk", WRONG_AFTER_SEGMENT_MEAN, module="qplug_sdk:plugin")
    model, data = _graph_batches()
    with pytest.warns(UserWarning, match="this region is kept in reference form, the rest of the partition "
                                         "compiled without it"):
        qmodel = qp.quantize(model, data[0], data, backend="sdk")
    report = qp.quantization_report(qmodel)
    assert {layer: kernel.startswith("delegate:") for layer, kernel in report.kernels.items()} == \
        {"a": True, "b": True, "c": True} and report.reference == {"sigmoid": "backend 'sdk' does not take sigmoid"}
    compiled = {p["name"] for p in report.partitions}
    comparison = qp.compare(model, qmodel, data)
    rows = _partition_rows(comparison)
    assert {row.name for row in rows} == compiled and all(row.num_outputs == len(data) for row in rows)
    assert all(row.reference_sqnr_db == math.inf for row in rows)  # the compiler is right in these
    assert all(30 < row.sqnr_db for row in rows)  # against float: about 8-bit's 40 dB per partition
    assert comparison.output_sqnr_db > 25
    loaded = qp.load(qp.save(qmodel, tmp_path / "model.safetensors"))  # load plans the same partitions
    assert {p["name"] for p in qp.quantization_report(loaded).partitions} == compiled
    with torch.no_grad():
        assert torch.equal(loaded(*data[1]), qmodel(*data[1]))


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_a_delegate_models_segment_mean_is_compared(plugin_autoload, backend):
    """Whether or not the runtime computes the segment mean right (ONNX Runtime and OpenVINO did
    not: the partition kept its reference form), compare gives rows only for compiled partitions."""
    model, data = _graph_batches()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a contract fallback warns; whether there is one varies
        qmodel = qp.quantize(model, data[0], data, backend=backend)
    report = qp.compare(model, qmodel, data)
    compiled = {p["name"] for p in qp.quantization_report(qmodel).partitions}
    assert {row.name for row in _partition_rows(report)} == compiled
    assert all(row.reference_sqnr_db > 30 and row.sqnr_db > 25 for row in _partition_rows(report))
    assert report.output_sqnr_db > 25


def test_a_partitions_float_form_runs_the_clamp_its_quantize_absorbed(fake_dist):
    """The ReLU6 after a conv is realised by the conv's output Quantize: the float form, whose
    quantizes are identities, runs it again (without it, onnxruntime's conv+ReLU6 read 2.2 dB)."""
    fake_dist("qplug-sdk", SDK, module="qplug_sdk:plugin")
    __import__("qplug_sdk").OFF_BY.update(steps=0, nan=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU6(), nn.Conv2d(8, 8, 3), nn.Sigmoid()).eval()
    data = [(torch.randn(2, 3, 8, 8) * 4,) for _ in range(3)]
    qmodel = qp.quantize(model, data[0], data, backend="sdk")
    assert "0" in qp.compare(model, qmodel, data).skipped  # inside the partition
    (row,) = _partition_rows(qp.compare(qp.fuse_fx(model, data[0], backend="sdk"), qmodel, data))
    assert row.reference_sqnr_db == math.inf and row.sqnr_db > 30


class _FunctionalConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 3, 3, 3) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(torch.nn.functional.conv2d(x, self.weight))


def test_a_layer_made_from_a_functional_call_inside_a_partition_is_listed_in_skipped(fake_dist):
    """``conv2d_module`` has no module of its own in the delegated model: it is named as measured
    with its partition, not left out of the report."""
    fake_dist("qplug-sdk", SDK, module="qplug_sdk:plugin")
    __import__("qplug_sdk").OFF_BY.update(steps=0, nan=False)
    torch.manual_seed(0)
    model = _FunctionalConv().eval()
    data = [(torch.randn(2, 3, 8, 8),) for _ in range(2)]
    report = qp.compare(model, qp.quantize(model, data[0], data, backend="sdk"), data)
    (row,) = _partition_rows(report)
    assert report.skipped == {"conv2d_module": f"inside compiled partition {row.name}: measured as part of it"}
