"""A deleted delegated model lets go of its int8 weights: exporting a partition left copies of
them held by torch.export's map of the last traced graph and by onnxscript's rewrite rules (the
last graph they matched) until the process exported something else; a process quantizing many
models (a sweep, ``backend="auto"``, a notebook) kept one model's weights too many."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import qplug_core as qp

SHAPES = {(37, 19), (11, 37)}  # the int8 weights of the model below, shapes no other test uses


def int8_weights_alive() -> list[weakref.ref]:
    """A weakref to every int8 tensor in the process shaped like one of the model's weights."""
    return [weakref.ref(o) for o in gc.get_objects()
            if issubclass(type(o), torch.Tensor) and o.dtype == torch.int8 and tuple(o.shape) in SHAPES]


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_int8_weights_of_a_deleted_delegated_model_are_collected(plugin_autoload, backend):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(19, 37), nn.ReLU(), nn.Linear(37, 11)).eval()
    example = (torch.randn(4, 19),)
    qmodel = qp.quantize(model, example, [example], backend=backend, progress=False)
    qmodel(*example)
    weights = int8_weights_alive()
    assert len(weights) >= 2
    del qmodel, model
    gc.collect()
    assert [ref() for ref in weights if ref() is not None] == []
