"""What a loaded graph can reach: no uninitialised memory, only tensors as receivers (issue 27).

Every case edits a real file written by ``qp.save`` as an attacker would. ``torch.empty(3000)``
returned in a loaded graph gave back another tensor's freed values (a server loading user models
leaks other requests' data); ``get_attr`` paths and method calls reached bound methods, module
hooks and storage classes by names that looked harmless. The same rules refuse the same graphs at
save time.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from artifactkit import reference_model, with_nodes

from qplug_core.config.names import TENSOR_ATTRIBUTES, Kind, name_table
from qplug_core.errors import SerializationError
from qplug_core.serialization import capture_artifact, load, save

#: ops and methods whose result holds uninitialised memory
UNINITIALISED_OPS = ["torch.empty", "torch.empty_like", "torch.empty_strided", "torch.empty_permuted",
                     "torch.resize_as_", "aten::empty.memory_format", "aten::empty_like.default",
                     "aten::empty_strided.default", "aten::new_empty.default",
                     "aten::new_empty_strided.default", "aten::resize_.default",
                     "aten::resize_as_.default", "aten::empty_permuted.default"]
UNINITIALISED_METHODS = ["new_empty", "new_empty_strided", "new", "resize_", "resize_as_", "resize"]


@pytest.fixture(scope="module")
def good_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(reference_model(), tmp_path_factory.mktemp("good") / "good.safetensors")


def _with_nodes(good_file: Path, tmp_path: Path, *nodes: dict) -> Path:
    return with_nodes(good_file, tmp_path / "edited.safetensors", *nodes)


@pytest.mark.parametrize("op", UNINITIALISED_OPS)
def test_no_op_returning_uninitialised_memory_loads(good_file, tmp_path, op):
    path = _with_nodes(good_file, tmp_path, {"op": "call_function", "name": "leak", "target": op,
                                             "args": [[3000]]})
    with pytest.raises(SerializationError, match=f"disallowed name '{op}'"):
        load(path)


@pytest.mark.parametrize("method", UNINITIALISED_METHODS)
def test_no_method_returning_uninitialised_memory_loads(good_file, tmp_path, method):
    path = _with_nodes(good_file, tmp_path, {"op": "call_method", "name": "leak", "target": method,
                                             "args": [{"node": "x"}, 3000]})
    with pytest.raises(SerializationError, match=f"method name '{method}' is not a tensor method"):
        load(path)


def test_the_table_holds_no_uninitialised_constructor():
    """A sweep, so that an op torch adds later (``empty_*``) is caught by the prefix rule."""
    table = name_table()
    ops = [n for n in table.names([Kind.OP]) if n.rpartition(".")[2].startswith(("empty", "new_empty",
                                                                                 "resize"))]
    assert ops == []
    assert not {m for m in TENSOR_ATTRIBUTES if m.startswith(("empty", "new_empty", "resize"))}
    assert "new" not in TENSOR_ATTRIBUTES and "storage_type" not in TENSOR_ATTRIBUTES


#: get_attr paths that name something other than a submodule or a tensor of the model
HOSTILE_PATHS = {
    "bound method of a tensor": "fc.module.weight.untyped_storage",
    "module hooks": "fc._forward_hooks",
    "bound method of a module": "fc.forward",
    "autograd node": "fc.module.weight.grad_fn",
    "parameters dict": "fc._parameters",
}


@pytest.mark.parametrize("target", list(HOSTILE_PATHS.values()), ids=list(HOSTILE_PATHS))
def test_get_attr_reaches_only_submodules_and_tensors(good_file, tmp_path, target):
    path = _with_nodes(good_file, tmp_path, {"op": "get_attr", "name": "evil", "target": target})
    with pytest.raises(SerializationError, match="not a submodule, parameter, buffer or tensor"):
        load(path)
    gm = reference_model()  # the same graph is refused when saving
    output = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(output):
        evil = gm.graph.get_attr(target)
    output.args = (evil,)
    with pytest.raises(SerializationError, match="not a submodule, parameter, buffer or tensor"):
        capture_artifact(gm)


#: method calls on values that are not tensors (nodes: (op, target, args))
HOSTILE_RECEIVERS = {
    "method of a dtype": [("call_function", "builtins.getattr", [{"node": "x"}, "dtype"]),
                          ("call_method", "to", [{"node": "r0"}, "cpu"])],
    "method of a size": [("call_function", "builtins.getattr", [{"node": "x"}, "shape"]),
                         ("call_method", "view", [{"node": "r0"}, -1])],
    "attribute of a list": [("call_method", "tolist", [{"node": "x"}]),
                            ("call_function", "builtins.getattr", [{"node": "r0"}, "copy_"])],
    "method of a literal": [("call_method", "split", ["a.b", "."])],
    "method of a module": [("get_attr", "fc", []), ("call_method", "to", [{"node": "r0"}, "cpu"])],
    "method on a method's result on a non-tensor": [
        ("call_function", "builtins.getattr", [{"node": "x"}, "device"]),
        ("call_function", "builtins.getattr", [{"node": "r0"}, "type"]),
        ("call_method", "index", [{"node": "r1"}, "c"])],
}


@pytest.mark.parametrize("nodes", list(HOSTILE_RECEIVERS.values()), ids=list(HOSTILE_RECEIVERS))
def test_methods_act_only_on_tensors(good_file, tmp_path, nodes):
    docs = [{"op": op, "name": f"r{i}", "target": target, "args": args}
            for i, (op, target, args) in enumerate(nodes)]
    with pytest.raises(SerializationError, match="acts on a"):
        load(_with_nodes(good_file, tmp_path, *docs))


def test_harmless_reads_of_dtype_and_device_still_load(good_file, tmp_path):
    """``x.device.type`` and ``x.dtype.is_floating_point`` are what real traced graphs do."""
    nodes = [{"op": "call_function", "name": "device", "target": "builtins.getattr",
              "args": [{"node": "x"}, "device"]},
             {"op": "call_function", "name": "kind", "target": "builtins.getattr",
              "args": [{"node": "device"}, "type"]}]
    model = load(_with_nodes(good_file, tmp_path, *nodes))
    assert model(torch.randn(2, 4)) == "cpu"
