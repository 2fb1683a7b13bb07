"""Model inputs that are not tensors (``forward(x, scale: float)``) stay out of compiled partitions.

A compiled partition is a serialized model (ONNX, an SDK's graph) whose inputs are tensors: a
Python number given to ``forward`` cannot be fed to it (ONNX Runtime and OpenVINO kept the whole
model in reference form, ``'float' object has no attribute 'shape'``), and baked in as a constant
it would be wrong for the next call's value. So the ops reading one run in PyTorch, on each call's
value, and the partitions are planned around them.
"""

from __future__ import annotations

from torch import fx

from qplug_core.flows.tags import VALUE_KIND


def python_input_readers(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """The nodes reading a model input that is not a tensor, with why they run in PyTorch."""
    readers: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.meta.get(VALUE_KIND) == "other":
            why = (f"it reads forward() argument {node.target!r}, which is not a tensor: compiled partitions "
                   "take tensors only, so this op runs in PyTorch on each call's value")
            for user in node.users:
                readers.setdefault(user, why)
    return readers


__all__ = ["python_input_readers"]
