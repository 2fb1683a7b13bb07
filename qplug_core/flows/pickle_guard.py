"""``torch.save(qmodel)`` says to use ``qp.save`` instead of failing deep inside pickle.

An int8 model holds packed kernel weights and compiled sessions that pickle cannot carry (torch
raises about a pybind11 object, or an ``AttributeError``), and unpickling a model runs code
anyway (docs/security.md). torch.fx gives every GraphModule instance a class of its own, so
refusing on that class touches no other model.
"""

from __future__ import annotations

from typing import Any, NoReturn

from torch import fx

from qplug_core.errors import SerializationError

MESSAGE = ("a qplug int8 model cannot be pickled (torch.save / pickle.dump): its kernels hold "
           "packed weights and compiled runtimes, and unpickling runs code. Save it with "
           "qp.save(model, 'model.safetensors') and read it back with qp.load(path)")


def _refuse(self: Any, *args: Any) -> NoReturn:
    raise SerializationError(MESSAGE)


def refuse_pickle(gm: fx.GraphModule) -> None:
    """Make pickling ``gm`` (only this instance: its class is its own) raise :data:`MESSAGE`."""
    cls = type(gm)
    if cls is not fx.GraphModule:  # never patch the shared base class
        cls.__reduce_ex__ = _refuse  # type: ignore[method-assign]
        cls.__reduce__ = _refuse  # type: ignore[method-assign]
