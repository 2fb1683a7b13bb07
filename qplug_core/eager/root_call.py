"""An eager-converted model's own call: under the backend's engine, naming the layer a failure came from.

Both are needed on every call of the model, and one wrapper of its ``forward`` on the instance does
them: ops without packed weights (pooling, add, cat, clamp on quantized tensors) dispatch on the
global engine, so the call runs under a lease on the backend's (:mod:`~qplug_core.kernels.engine_lease`,
the caller's restored after it, also on errors), and an error is raised as
:func:`~qplug_core.eager.failed_layers.named_error` gives it. The engine-pin hooks graph-mode
models keep (:func:`~qplug_core.kernels.base.pin_engine`) take torch's hooked call path, ~3 us per
call, the most qplug added to a small batch-1 CNN (``bench/bench_eager_call_overhead.py``); the
wrapper costs ~1.5 us. A model with its own ``forward`` on the instance keeps it, and gets the hooks.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from qplug_core.eager.failed_layers import named_error
from qplug_core.kernels import engine_lease
from qplug_core.kernels.base import pin_engine

__all__ = ["own_call"]


def own_call(model: nn.Module, names: set[str], engine: str | None) -> None:
    """Make calls of converted ``model`` run under ``engine`` (None: the caller's) and name the
    module among ``names`` (its swapped ones) that failed."""
    if "forward" in vars(model):
        pin_engine(model, engine)
    elif names or engine is not None:
        _bind(model, frozenset(names), engine)


#: the instance entries :func:`_bind` sets, each bound to its model
_BOUND = ("forward", "__reduce_ex__")


def _bind(model: nn.Module, names: frozenset[str], engine: str | None) -> None:
    """Put the call on the instance. A shallow copy shares instance entries, so one bound to this
    model would make ``copy.copy(model)`` call the original; copy, deepcopy and pickle look
    ``__reduce_ex__`` up on the instance too, and this one rebuilds the model bound to itself
    (partials of module-level functions: the model still pickles)."""
    vars(model)["forward"] = functools.partial(_model_call, model, names, engine)
    vars(model)["__reduce_ex__"] = functools.partial(_reduce, model, names, engine)


def _reduce(model: nn.Module, names: frozenset[str], engine: str | None,
            protocol: int) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    state = {key: value for key, value in vars(model).items() if key not in _BOUND}
    return _rebound, (type(model), names, engine), state


def _rebound(cls: type[nn.Module], names: frozenset[str], engine: str | None) -> nn.Module:
    """A new ``cls`` bound to its own call; the copy protocol then sets its state."""
    model = cls.__new__(cls)
    _bind(model, names, engine)
    return model


def _model_call(model: nn.Module, names: frozenset[str], engine: str | None, *args: Any, **kwargs: Any) -> Any:
    token = engine_lease.acquire(engine) if engine is not None else None
    try:
        return type(model).forward(model, *args, **kwargs)
    except Exception as error:
        instead = named_error(model, names, error)
        if instead is None:
            raise
        raise instead from error
    finally:
        if token is not None:
            engine_lease.release(token)
