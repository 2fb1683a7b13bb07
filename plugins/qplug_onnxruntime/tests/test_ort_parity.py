"""Parity: ONNX Runtime computes what qplug's reference form says, with ORT's graph optimizations
(its QDQ fusions into QLinearConv, QGemm, QLinearAdd, ...) on and off.

Two checks. Layer by layer (``plugin_api.layer_parity``): every int8 region runs in ORT on the
reference form's own integer inputs and its output must equal the reference's within one
quantization step on >= 99% of elements, for every zoo model (ResNet-50 aside, see MODELS). End
to end: the whole model's output within one step on >= 99% of elements, for every zoo model but
the deep residual one (DIVERGES, held to a floor instead).
"""

from __future__ import annotations

import functools

import pytest
import torch
from ort_testkit import inputs, output_step, quantized_pair, within_one_step

import qplug_core as qp
from qplug_core.plugin_api import layer_parity

from qplug_onnxruntime import SessionSettings, settings
from qplug_onnxruntime.session import OrtPartition
from qplug_onnxruntime.support import OrtSupport, partition_to_onnx

SLOW = {"resnet18", "mobilenet_v2"}
LEVELS = ("all", "disable")
#: Measured, not a backend fault: in these random-weight residual nets one value rounding the other
#: way (torch's float32 conv against ORT's exact int32 sums) changes the next layer's inputs and
#: the difference grows, so at the output fewer elements agree within one step, by how the CPU's
#: float32 conv rounds: resnet18 ~95% on AMD EPYC Zen 4 and 100% (bit-exact) on an Intel Xeon with
#: AMX; resnet50 (no longer run) ~80% on Zen 4 and 79-87% on the Xeon, max 3-5 steps. fbgemm's own kernels agree
#: with the reference form on ResNet-50 no better (77%), and the reference form run in float64
#: agrees with its float32 run on 90%. Layer by layer ORT agrees on 100% (test above). Held to a
#: floor below every CPU measured, not to an expected failure (which passed on the Xeon).
DIVERGES = {"resnet18": 0.90}
#: both tests check the same quantized models (the end-to-end test only rebuilds ORT sessions)
_pair = functools.lru_cache(maxsize=None)(quantized_pair)


#: every zoo model but ResNet-50, whose int8 regions are ResNet-18's kinds (1x1 and 3x3 conv-relu,
#: add-relu, linear) four times over: it doubled these tests' time and checked nothing new
MODELS = [pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else [])
          for name in qp.zoo.list_models() if name != "resnet50"]


def _compiler(level: str, exported: dict):
    """Sessions at graph optimization ``level`` of the ONNX models in ``exported`` (by the
    side-by-side graph's code: both levels check the same graph, exported once)."""
    settings = SessionSettings(num_threads=1, graph_optimization=level)

    def to_onnx(partition, example):
        if partition.code not in exported:
            exported[partition.code] = partition_to_onnx(partition, example)
        return exported[partition.code]

    return lambda partition, example: OrtPartition(partition, example, to_onnx, settings)


@pytest.mark.parametrize("name", MODELS)
def test_every_int8_region_matches_the_reference_form_within_one_step(name):
    _, _, reference = _pair(name)
    exported: dict = {}
    for level in LEVELS:
        parity = layer_parity(reference, _compiler(level, exported), inputs(name, 10),
                              operator_support=OrtSupport())
        assert parity.regions, f"{name}: no int8 region was checked"
        assert parity.ok, f"{name}, graph optimization {level!r}: {parity.problems}"  # bias included
        assert parity.within >= 0.999, f"{name}, graph optimization {level!r}: {parity.within:.4%}"


@pytest.mark.parametrize("name", MODELS)
def test_ort_matches_the_reference_form_within_one_step(name):
    _, ort_model, reference = _pair(name)
    partitions = [m for m in ort_model.modules() if isinstance(m, OrtPartition)]
    assert partitions, f"{name}: nothing was delegated to ONNX Runtime"
    step = output_step(reference)
    held_out = [inputs(name, seed) for seed in (10, 11)]
    for level in LEVELS:
        for partition in partitions:
            partition.rebuild(SessionSettings(num_threads=1, graph_optimization=level))
        with torch.no_grad():
            got = torch.cat([ort_model(*x).flatten() for x in held_out])
            expected = torch.cat([reference(*x).flatten() for x in held_out])
        agreement = within_one_step(got, expected, step)
        floor = DIVERGES.get(name, 0.99)
        assert agreement >= floor, f"{name}, graph optimization {level!r}: {agreement:.2%} within one step"


@pytest.mark.parametrize("name", MODELS)
def test_loaded_model_answers_bit_identically(name, tmp_path):
    """``qp.load(qp.save(m))`` == ``m`` (issue 25): the same partitions, compiled at the first call."""
    _, ort_model, _ = _pair(name)
    for partition in ort_model.modules():  # the test above leaves other session settings behind
        if isinstance(partition, OrtPartition):
            partition.rebuild(settings())
    loaded = qp.load(qp.save(ort_model, tmp_path / f"{name}.safetensors"))
    assert qp.quantization_report(loaded).kernels == qp.quantization_report(ort_model).kernels
    with torch.no_grad():
        for seed in (12, 13):
            x = inputs(name, seed)
            assert torch.equal(loaded(*x), ort_model(*x))
