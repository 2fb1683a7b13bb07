"""Issue 24: a delegated partition that breaks the contract because its kernels sum u8 x s8
pairs in int16 (x86 without VNNI) is compiled again with 7-bit weights before it is given up, at
convert and, for a file converted on a CPU with VNNI, at its first call after ``qp.load`` on one
without.

The SDK here stands for a compiler on such kernels (ONNX Runtime's MLAS U8S8 kernels, which
cannot be forced to AVX2 on a VNNI host): it runs the partition with each linear's integer GEMM
computed by the brute-force ``vpmaddubsw`` definition of ``test_int16_pair_sums``. Its defaults
give 8-bit weights (the plugin did not ask the core for safe ones), so the partition saturates.
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

import qplug_core as qp
from qplug_core.flows.snapshot import snapshot_of
from qplug_core.plugin_api import override_cpu_flags
from tests.reliability.test_int16_pair_sums import AVX2, VNNI
from tests.reliability.test_weight_bits import TwoLayers, inputs, saturated, weight_ranges

SDK = '''
import copy

import torch
from torch import nn
from qplug_core.plugin_api import (BackendSpec, Delegate, DTypeConfigSet, Int8Arithmetic,
                                   OperatorSupportBase, cpu_int8, default_qconfig_mapping,
                                   hookimpl)
from qplug_core.kernels.reference import Dequantize, ReferenceWeighted
from tests.reliability.test_int16_pair_sums import vpmaddubsw_matmul

BROKEN = False  # an SDK wrong whatever the weights (its linears' outputs doubled)
FOLLOWS_CPU = False  # int16 pairs only where the CPU has no VNNI (exact int32 sums elsewhere)


class Int16PairLinear(nn.Module):
    """A linear of the partition as the SDK runs it: u8 codes x s8 codes in int16 pairs."""

    def __init__(self, layer, dequantize):
        super().__init__()
        self.layer, self.dequantize = layer, dequantize

    def forward(self, x):
        a_q, w_q = self.dequantize.qparams, self.layer.weight_qparams
        fused = isinstance(self.layer.module, nn.Sequential)  # LinearReLU: the linear, then the rest
        linear = self.layer.module[0] if fused else self.layer.module
        codes = torch.round(x / a_q.scale) + a_q.zero_point
        w_scale = w_q.scale.reshape(-1, 1)
        weights = torch.round(linear.weight / w_scale)
        rows = codes.reshape(-1, codes.shape[-1]).long()
        if FOLLOWS_CPU and not cpu_int8().int16_pair_sums:
            total = rows @ weights.long().t()
        else:
            total, _ = vpmaddubsw_matmul(rows, weights.long())
        shifted = total - a_q.zero_point * weights.long().sum(1)
        out = shifted.double() * a_q.scale * w_scale.flatten() * (2.0 if BROKEN else 1.0)
        out = (out + linear.bias).float().reshape(*x.shape[:-1], -1)
        for after in list(self.layer.module)[1:] if fused else []:
            out = after(out)
        return out


def compile_partition(partition, example_inputs):
    partition = copy.deepcopy(partition)
    for node in partition.graph.nodes:
        module = partition.get_submodule(node.target) if node.op == "call_module" else None
        if isinstance(module, ReferenceWeighted):
            source = partition.get_submodule(node.args[0].target)
            assert isinstance(source, Dequantize)
            partition.set_submodule(node.target, Int16PairLinear(module, source))
    partition.recompile()
    return partition


class TakesAll(OperatorSupportBase):
    def is_node_supported(self, submodules, node):
        return True


@hookimpl
def qplug_register_backends():
    return [BackendSpec("int16sdk", "an SDK on u8 x s8 int16 pair kernels",
                        arithmetic=Int8Arithmetic.U8S8_INT16_PAIRS_WITHOUT_VNNI)]


@hookimpl
def qplug_backend_pattern_configs(backend):
    return DTypeConfigSet.native().pattern_configs() if backend == "int16sdk" else []


@hookimpl
def qplug_default_qconfig_mapping(backend, mode):
    return default_qconfig_mapping(mode, per_channel=True) if backend == "int16sdk" else None


@hookimpl
def qplug_delegate(backend):
    return Delegate(operator_support=TakesAll(), compile=compile_partition) if backend == "int16sdk" else None
'''


def convert(flags: str):
    with override_cpu_flags(flags), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        observed = qp.prepare_fx(TwoLayers().eval(), None, inputs(0), backend="int16sdk")
        qp.calibrate(observed, [inputs(s) for s in range(3)])
        lowered = qp.convert_fx(observed)
    return lowered, [str(w.message) for w in caught if "partition" in str(w.message)]


@pytest.fixture
def sdk(fake_dist):
    return fake_dist("qplug-int16sdk", SDK)


def test_a_saturating_partition_is_compiled_again_with_7_bit_weights(sdk):
    lowered, messages = convert(AVX2)
    report = qp.quantization_report(lowered)
    assert not report.reference and len(report.partitions) == 1  # compiled, not the reference form
    note = report.partitions[0]["note"]
    assert note.startswith("compiled with 7-bit weights in ") and "int16" in note
    assert messages == [f"qplug: backend 'int16sdk': partition delegate_0 {note}"]
    reference = snapshot_of(lowered).graph_module  # what qp.save writes: the form that passed
    assert set(weight_ranges(reference).values()) == {(-64, 64)}
    assert saturated(reference)["hot"] == 0
    with torch.no_grad():  # the SDK now computes the reference form's numbers on held-out data
        expected, got = reference(*inputs(5)), lowered(*inputs(5))
    step = float(expected.max() - expected.min()) / 255
    assert float((got - expected).abs().max()) <= 1.01 * step


def test_the_saved_file_holds_the_form_that_passed(sdk, tmp_path):
    lowered, _ = convert(AVX2)
    qp.save(lowered, tmp_path / "model.qplug")
    with override_cpu_flags(AVX2):
        loaded = qp.load(tmp_path / "model.qplug")
        with torch.no_grad():
            assert torch.equal(loaded(*inputs(5)), lowered(*inputs(5)))


def test_with_vnni_nothing_is_changed(sdk):
    """The same SDK on a VNNI CPU (its kernels accumulate in int32 there, by its arithmetic):
    its saturation is then not int16 pairs' doing, so nothing is recompiled with 7-bit weights:
    the region it gets wrong stays in reference form, the other one is compiled without it."""
    lowered, messages = convert(VNNI)
    report = qp.quantization_report(lowered)
    assert [p["int8_regions"] for p in report.partitions] == [1] and list(report.reference) == ["hot"]
    assert messages and all("this region is kept in reference form" in m for m in messages)
    assert set(weight_ranges(snapshot_of(lowered).graph_module).values()) == {(-128, 127)}


def test_a_partition_wrong_with_7_bit_weights_too_keeps_8_bit_reference_form(sdk):
    importlib.import_module("qplug_int16sdk").BROKEN = True
    lowered, messages = convert(AVX2)
    report = qp.quantization_report(lowered)
    assert not report.partitions
    reasons = set(report.reference.values())
    assert len(reasons) == 1 and "; with 7-bit weights too: " in reasons.pop()
    assert set(weight_ranges(snapshot_of(lowered).graph_module).values()) == {(-128, 127)}  # undone
    # its int8 regions compute in float in PyTorch now: listed with why, not the partition's call
    listed = {s.node: s for s in report.skipped}
    assert "delegate_0" not in listed and not any(s.partition for s in report.skipped)
    assert {(a, listed[a].reason) for a in report.reference} == set(report.reference.items())


def _converted_with_vnni_and_saved(path):
    importlib.import_module("qplug_int16sdk").FOLLOWS_CPU = True
    lowered, messages = convert(VNNI)
    assert messages == [] and len(qp.quantization_report(lowered).partitions) == 1
    assert set(weight_ranges(snapshot_of(lowered).graph_module).values()) == {(-128, 127)}
    qp.save(lowered, path)
    return lowered


def _first_call(path, flags):
    with override_cpu_flags(flags), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = qp.load(path)
        with torch.no_grad():
            out = loaded(*inputs(5))
    return loaded, out, [str(w.message) for w in caught if "partition" in str(w.message)]


def test_a_file_from_a_vnni_cpu_is_checked_at_its_first_call_without_vnni(sdk, tmp_path):
    lowered = _converted_with_vnni_and_saved(tmp_path / "model.qplug")
    with override_cpu_flags(VNNI), torch.no_grad():  # the SDK follows the CPU it runs on
        exact = lowered(*inputs(5))
    # without the check, the 8-bit weights saturate here: the SDK's plain output is far off
    with override_cpu_flags(AVX2), torch.no_grad():
        unchecked = qp.load(tmp_path / "model.qplug", backend="reference")
        saturating = importlib.import_module("qplug_int16sdk").compile_partition(
            unchecked, inputs(5))(*inputs(5))
    loaded, out, messages = _first_call(tmp_path / "model.qplug", AVX2)
    note = qp.quantization_report(loaded).partitions[0]["note"]
    assert note.startswith("compiled with 7-bit weights in ") and "int16" in note
    assert messages == [f"qplug: backend 'int16sdk': partition delegate_0 {note}"]
    assert qp.sqnr(exact, out) > qp.sqnr(exact, saturating) + 10  # 7 bits, not saturated pairs
    assert qp.sqnr(exact, out) > 30
    with torch.no_grad():  # later calls run the compiled 7-bit partition, no second check
        assert torch.equal(loaded(*inputs(5)), out)


def test_the_same_file_on_a_vnni_cpu_is_not_rechecked(sdk, tmp_path):
    lowered = _converted_with_vnni_and_saved(tmp_path / "model.qplug")
    loaded, out, messages = _first_call(tmp_path / "model.qplug", VNNI)
    with override_cpu_flags(VNNI), torch.no_grad():  # the SDK follows the CPU it runs on
        assert torch.equal(out, lowered(*inputs(5)))
    assert messages == [] and qp.quantization_report(loaded).partitions[0]["note"] == ""


def test_a_loaded_partition_wrong_with_7_bit_weights_too_runs_its_reference_form(sdk, tmp_path):
    _converted_with_vnni_and_saved(tmp_path / "model.qplug")
    importlib.import_module("qplug_int16sdk").BROKEN = True
    loaded, out, messages = _first_call(tmp_path / "model.qplug", AVX2)
    report = qp.quantization_report(loaded)
    assert not report.partitions and not report.kernels
    (reason,) = set(report.reference.values())
    assert "on its first inputs after qp.load on this CPU" in reason and "; with 7-bit weights too: " in reason
    assert messages == [f"qplug: backend 'int16sdk': {reason}"]
    listed = {s.node: s for s in report.skipped}  # its regions, now float in PyTorch
    assert {(a, listed[a].reason) for a in ("safe", "hot")} == {("safe", reason), ("hot", reason)}
    assert not any(s.partition for s in report.skipped)
    with torch.no_grad():
        reference = qp.load(tmp_path / "model.qplug", backend="reference")(*inputs(5))
    assert torch.equal(out, reference)
