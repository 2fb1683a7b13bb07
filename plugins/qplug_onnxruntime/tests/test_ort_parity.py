"""Parity: for every zoo model, ONNX Runtime's output equals qplug's reference form within one
quantization step on >= 99% of elements, with ORT's graph optimizations on and off."""

from __future__ import annotations

import pytest
import torch
from ort_testkit import inputs, output_step, quantized_pair, within_one_step
from qplug_onnxruntime import SessionSettings
from qplug_onnxruntime.session import OrtPartition

import qplug_core as qp

SLOW = {"resnet18", "resnet50", "mobilenet_v2"}
#: Known gap (measured): in the deep residual nets a one-step difference in one layer (int32 bias
#: rounding, ORT's integer requantization) grows through the next ones, so at the output only
#: 95% (resnet18) / 80% (resnet50) of elements agree within one step, with optimizations on and
#: off alike; with float biases the export is bit-exact in ORT's float mode. strict: a fix shows.
DIVERGES = {"resnet18", "resnet50"}


def _case(name: str):
    marks = [pytest.mark.slow] if name in SLOW else []
    if name in DIVERGES:
        marks.append(pytest.mark.xfail(strict=True, reason="one-step differences grow through deep "
                                                           "residual stacks (see DIVERGES)"))
    return pytest.param(name, marks=marks)


@pytest.mark.parametrize("name", [_case(n) for n in qp.zoo.list_models()])
def test_ort_matches_the_reference_form_within_one_step(name):
    _, ort_model, reference = quantized_pair(name)
    partitions = [m for m in ort_model.modules() if isinstance(m, OrtPartition)]
    assert partitions, f"{name}: nothing was delegated to ONNX Runtime"
    step = output_step(reference)
    held_out = [inputs(name, seed) for seed in (10, 11)]
    for level in ("all", "disable"):
        for partition in partitions:
            partition.rebuild(SessionSettings(num_threads=1, graph_optimization=level))
        with torch.no_grad():
            got = torch.cat([ort_model(*x).flatten() for x in held_out])
            expected = torch.cat([reference(*x).flatten() for x in held_out])
        agreement = within_one_step(got, expected, step)
        assert agreement >= 0.99, f"{name}, graph optimization {level!r}: {agreement:.2%} within one step"
