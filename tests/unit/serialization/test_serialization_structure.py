"""An exported model's list and dict outputs survive save -> load (s27 dense F9): the file stored
the graph but not export's pytree code, so a detector returning ``{"cls": [...], "box": [...]}``
came back returning a flat tuple. So did OrderedDicts, namedtuples and Hugging Face ``ModelOutput``s
(``loaded(**inputs).last_hidden_state`` failed), which a file now names only through a table."""

from __future__ import annotations

import pickle
import subprocess
import sys
from collections import OrderedDict, namedtuple

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

import qplug_core as qp
from qplug_core.errors import SerializationError
from tests.reliability.artifactkit import rewrite

Boxes = namedtuple("Boxes", ["cls", "box"])
Renamed = namedtuple("Renamed", ["cls", "def"], rename=True)  # fields cls, _1


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
        if self.kind == "odict":
            return OrderedDict([("cls", self.cls(h)), ("box", self.box(h))])
        if self.kind == "renamed":
            return Renamed(self.cls(h), self.box(h))
        return Boxes(self.cls(h), self.box(h))


def _quantized(kind: str):
    torch.manual_seed(0)
    data = [torch.randn(1, 3, 12, 12) for _ in range(2)]
    return qp.quantize(Heads(kind).eval(), data[0], data, backend="reference", capture="export"), data[1]


def _shape(output):
    return tree_map(lambda t: type(t).__name__, output)


def _same_leaves(before, after) -> bool:
    return all(torch.equal(a, b) for a, b in zip(tree_leaves(before), tree_leaves(after), strict=True))


@pytest.mark.parametrize("kind", ["list", "dict", "odict"])
def test_exported_containers_come_back_after_load(tmp_path, kind):
    quantized, x = _quantized(kind)
    loaded = qp.load(qp.save(quantized, tmp_path / "heads.safetensors"))
    with torch.no_grad():
        before, after = quantized(x), loaded(x)
    assert _shape(after) == _shape(before) and type(after) is type(before)
    assert _same_leaves(before, after)


def test_a_namedtuple_output_comes_back_as_a_namedtuple_of_the_same_name_and_fields(tmp_path):
    quantized, x = _quantized("namedtuple")
    loaded = qp.load(qp.save(quantized, tmp_path / "heads.safetensors"))
    with torch.no_grad():
        before, after = quantized(x), loaded(x)
    assert type(after).__name__ == "Boxes" and after._fields == ("cls", "box")
    assert torch.equal(after.box, before.box) and _same_leaves(before, after)
    assert type(qp.load(tmp_path / "heads.safetensors")(x)) is type(after)  # one class per name and fields
    # a worker pool's output crosses to its parent, which made no such class
    read = "import pickle, sys; b = pickle.loads(sys.stdin.buffer.read()); print(type(b).__name__, b._fields)"
    done = subprocess.run([sys.executable, "-c", read], input=pickle.dumps(after), capture_output=True, check=True)
    assert done.stdout.decode().strip() == "Boxes ('cls', 'box')", done.stderr.decode()[-500:]


def test_a_namedtuple_with_a_private_field_is_saved_as_a_tuple_with_a_warning(tmp_path):
    quantized, x = _quantized("renamed")
    with pytest.warns(UserWarning, match=r"returns output as a tuple \(it is a Renamed\)"):
        path = qp.save(quantized, tmp_path / "heads.safetensors")
    with torch.no_grad():
        assert type(qp.load(path)(x)) is tuple


@pytest.mark.slow  # ~4 s: torch.export of a one-layer BERT
def test_a_bert_model_output_comes_back_after_load(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16)
    ids, mask = torch.randint(0, 64, (2, 8)), torch.ones(2, 8, dtype=torch.long)
    quantized = qp.quantize(transformers.BertModel(config).eval(), (ids, mask), [(ids, mask)],
                            backend="reference", capture="export")
    loaded = qp.load(qp.save(quantized, tmp_path / "bert.safetensors"))
    inputs = {"input_ids": ids.flip(1), "attention_mask": mask}
    with torch.no_grad():
        before, after = quantized(**inputs), loaded(**inputs)
    assert type(after) is transformers.modeling_outputs.BaseModelOutputWithPoolingAndCrossAttentions
    assert torch.equal(after.last_hidden_state, before.last_hidden_state)
    assert torch.equal(after.pooler_output, before.pooler_output)


def _name_another_class(document, tensors) -> None:
    document["model"]["pytree"]["out"]["mapping"]["type"] = "this.Output"  # importing `this` prints


def test_a_file_naming_a_class_outside_the_table_loads_a_dict_and_imports_nothing(tmp_path):
    quantized, x = _quantized("odict")
    path = rewrite(qp.save(quantized, tmp_path / "heads.safetensors"), _name_another_class)
    assert "this" not in sys.modules
    with pytest.warns(UserWarning, match=r"returns model.pytree.out as a dict \(this.Output: qp.load builds only "):
        loaded = qp.load(path)
    assert "this" not in sys.modules
    with torch.no_grad():
        after = loaded(x)
    assert type(after) is dict and list(after) == ["cls", "box"] and _same_leaves(quantized(x), after)


def _drop_structure(document, tensors) -> None:
    del document["model"]["pytree"]  # as files written before the structure was recorded


def test_a_file_without_the_structure_loads_as_before(tmp_path):
    quantized, x = _quantized("odict")
    loaded = qp.load(rewrite(qp.save(quantized, tmp_path / "heads.safetensors"), _drop_structure))
    with torch.no_grad():
        before, after = quantized(x), loaded(x)
    assert type(after) is tuple and _same_leaves(before, after)


def _nest_output(document, tensors) -> None:
    out = document["model"]["pytree"]["out"]
    out["dict"][0][1] = {"list": [None, None]}  # one more output leaf than the graph returns


def _unknown_container(document, tensors) -> None:
    document["model"]["pytree"]["out"] = {"collections.OrderedDict": []}


def _namedtuple_named_by_a_path(document, tensors) -> None:
    document["model"]["pytree"]["out"] = {"namedtuple": {"type": "os.system", "items": [["cls", None]]}}


@pytest.mark.parametrize(("edit", "detail"), [
    (_nest_output, r"model.pytree.out: the structure holds 4 outputs, the graph has 3"),
    (_unknown_container, r"model.pytree.out: unknown key 'collections.OrderedDict'; allowed keys: dict, list, "
                         r"mapping, namedtuple, tuple"),
    (_namedtuple_named_by_a_path, r"model.pytree.out.namedtuple.type: namedtuple name 'os.system' is not a plain "
                                  r"Python identifier"),
])
def test_a_tampered_structure_is_refused(tmp_path, edit, detail):
    quantized, _ = _quantized("dict")
    with pytest.raises(SerializationError, match=detail):
        qp.load(rewrite(qp.save(quantized, tmp_path / "heads.safetensors"), edit))
