"""An exported model's list and dict outputs survive save -> load (s27 dense F9): the file stored
the graph but not export's pytree code, so a detector returning ``{"cls": [...], "box": [...]}``
came back returning a flat tuple."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

import qplug_core as qp
from qplug_core.errors import SerializationError
from tests.reliability.artifactkit import rewrite

Boxes = namedtuple("Boxes", ["cls", "box"])


class Heads(nn.Module):
    """A conv trunk and two 1x1 heads, returned in the container ``kind`` names."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.trunk = nn.Conv2d(3, 8, 3, padding=1)
        self.cls, self.box = nn.Conv2d(8, 4, 1), nn.Conv2d(8, 2, 1)

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        if self.kind == "list":
            return [self.cls(h), self.box(h)]
        if self.kind == "dict":
            return {"cls": [self.cls(h)], "box": [self.box(h), self.box(h) * 2]}
        return Boxes(self.cls(h), self.box(h))


def _quantized(kind: str):
    torch.manual_seed(0)
    data = [torch.randn(1, 3, 12, 12) for _ in range(2)]
    return qp.quantize(Heads(kind).eval(), data[0], data, backend="reference", capture="export"), data[1]


def _shape(output):
    return tree_map(lambda t: type(t).__name__, output)


@pytest.mark.parametrize("kind", ["list", "dict"])
def test_exported_containers_come_back_after_load(tmp_path, kind):
    quantized, x = _quantized(kind)
    loaded = qp.load(qp.save(quantized, tmp_path / "heads.safetensors"))
    with torch.no_grad():
        before, after = quantized(x), loaded(x)
    assert _shape(after) == _shape(before) and type(after) is type(before)
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves(before), tree_leaves(after), strict=True))


def test_a_namedtuple_output_is_saved_as_a_tuple_with_a_warning(tmp_path):
    quantized, x = _quantized("namedtuple")
    with pytest.warns(UserWarning, match=r"output is a Boxes: the loaded model takes or returns a tuple there"):
        path = qp.save(quantized, tmp_path / "heads.safetensors")
    with torch.no_grad():
        assert type(qp.load(path)(x)) is tuple


def _nest_output(document, tensors) -> None:
    out = document["model"]["pytree"]["out"]
    out["dict"][0][1] = {"list": [None, None]}  # one more output leaf than the graph returns


def _unknown_container(document, tensors) -> None:
    document["model"]["pytree"]["out"] = {"collections.OrderedDict": []}


@pytest.mark.parametrize(("edit", "detail"), [
    (_nest_output, r"model.pytree.out: the structure holds 4 outputs, the graph has 3"),
    (_unknown_container, r"model.pytree.out: unknown key 'collections.OrderedDict'; allowed keys: dict, list, tuple"),
])
def test_a_tampered_structure_is_refused(tmp_path, edit, detail):
    quantized, _ = _quantized("dict")
    with pytest.raises(SerializationError, match=detail):
        qp.load(rewrite(qp.save(quantized, tmp_path / "heads.safetensors"), edit))
