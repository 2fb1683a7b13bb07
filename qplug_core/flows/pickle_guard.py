"""``torch.save(qmodel)`` and ``torch.jit.script(qmodel)`` say to use ``qp.save`` instead of failing
deep inside torch.

An int8 model holds packed kernel weights and compiled sessions that pickle cannot carry (torch
raises about a pybind11 object, or an ``AttributeError``), and unpickling a model runs code
anyway (docs/security.md); TorchScript met qplug's hooks and printed a partition's ONNX bytes.
torch.fx gives every GraphModule instance a class of its own, so refusing on that class touches
no other model.
"""

from __future__ import annotations

from torch import fx

from qplug_core.ir.tracing import refuse_pickle, refuse_script


def refuse_torch_shipping(gm: fx.GraphModule) -> None:
    """Make pickling or scripting ``gm`` (only this instance: its class is its own) raise a qplug error."""
    cls = type(gm)
    if cls is not fx.GraphModule:  # never patch the shared base class
        cls.__reduce_ex__ = refuse_pickle  # type: ignore[method-assign,assignment]
        cls.__reduce__ = refuse_pickle  # type: ignore[method-assign,assignment]
        cls.__prepare_scriptable__ = refuse_script  # type: ignore[attr-defined]

