"""A one-time warning for a QAT model that training never updates because its optimizer holds
other parameters.

``prepare_qat_fx`` and ``qp.eager.prepare_qat`` return a copy (unless ``inplace=True``); torch.ao's
graph mode reused the float model's parameters, so an optimizer built before prepare worked there.
Here it steps the float model's parameters, and training runs on without moving a weight. One hook
on torch's optimizer steps (registered once per process, at the first QAT prepare, and never
removed: adding or removing a global hook while another thread's optimizer steps breaks that step)
watches the QAT models alive: a step of an optimizer holding any of a model's parameters ends its
watch (trained as meant); a step of one holding none of them while the model, in training mode, has
gradients counts, and the :data:`STEPS`-th warns once. Gradient accumulation over any number of
micro-batches, backward passes without an optimizer, and another model's optimizer stepping beside
the QAT model's do not warn. With no model watched a step costs one call; with one, a pass over its
parameters.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from qplug_core.errors import warn_user

#: optimizer steps of other parameters, with gradients on the QAT model's, before the warning
STEPS = 3

#: QAT model -> optimizer steps of other parameters seen while it had gradients
_watched: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
#: held while the watches are read or changed (optimizers may step in several threads)
_lock = threading.Lock()
_hook: list[Any] = []


def _step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if not _watched:
        return
    with _lock:
        _check(optimizer)


def _check(optimizer: Any) -> None:
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model, seen in list(_watched.items()):
        params = [p for p in model.parameters() if p.requires_grad]
        if any(id(p) in stepped for p in params):
            _watched.pop(model, None)
        elif model.training and any(p.grad is not None for p in params):
            _watched[model] = seen + 1
            if seen + 1 >= STEPS:
                _watched.pop(model, None)
                warn_user(
                    f"qplug: {STEPS} optimizer steps left this QAT model's parameters unchanged although "
                    "they had gradients (the optimizer holds none of them): is it built on the float "
                    "model? prepare_qat_fx / prepare_qat return a copy, so build the optimizer on the "
                    "returned model (torch.optim.SGD(prepared.parameters(), ...)) or pass inplace=True")


def watch_untrained(model: nn.Module) -> None:
    """Warn once if optimizers step while ``model`` (a QAT model) trains and none holds its parameters."""
    with _lock:
        if not _hook:
            _hook.append(register_optimizer_step_pre_hook(_step))
        _watched[model] = 0


def unwatch(model: nn.Module) -> None:
    """End the watch of ``model`` (converted in place; a converted copy was never watched)."""
    with _lock:
        _watched.pop(model, None)
