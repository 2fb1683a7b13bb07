"""A one-time warning for a QAT model that training never updates because its optimizer holds
other parameters.

``prepare_qat_fx`` and ``qp.eager.prepare_qat`` return a copy (unless ``inplace=True``); torch.ao's
graph mode reused the float model's parameters, so an optimizer built before prepare worked there.
Here it steps the float model's parameters, and training runs on without moving a weight. The watch
listens to optimizer steps (torch's global step hook): a step of an optimizer holding any of the QAT
model's parameters ends it (trained as meant); a step of one holding none of them while the model,
in training mode, has gradients counts, and the :data:`STEPS`-th warns once. Gradient accumulation
over any number of micro-batches, backward passes without an optimizer, and another model's
optimizer stepping beside the QAT model's do not warn. Until it ends, each optimizer step costs a
pass over the model's parameters.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from qplug_core.errors import warn_user

#: optimizer steps of other parameters, with gradients on the QAT model's, before the warning
STEPS = 3

_watches: weakref.WeakKeyDictionary[nn.Module, _UntrainedWatch] = weakref.WeakKeyDictionary()
#: step hooks of ended watches: torch iterates its hooks while one runs, so a hook that ends its
#: watch stays (doing nothing) until the next watch starts or ends
_ended: list[Any] = []


class _UntrainedWatch:
    def __init__(self, model: nn.Module) -> None:
        self.model = weakref.ref(model)
        self.foreign_steps = 0
        self.ended = False
        self.handle = register_optimizer_step_pre_hook(self)

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        model = None if self.ended else self.model()
        if model is None:
            self.stop()
            return
        params = [p for p in model.parameters() if p.requires_grad]
        own = {id(p) for p in params}
        if any(id(p) in own for group in optimizer.param_groups for p in group["params"]):
            self.stop()
        elif model.training and any(p.grad is not None for p in params):
            self.foreign_steps += 1
            if self.foreign_steps >= STEPS:
                self.stop()
                warn_user(
                    f"qplug: {STEPS} optimizer steps left this QAT model's parameters unchanged although "
                    "they had gradients (the optimizer holds none of them): is it built on the float "
                    "model? prepare_qat_fx / prepare_qat return a copy, so build the optimizer on the "
                    "returned model (torch.optim.SGD(prepared.parameters(), ...)) or pass inplace=True")

    def stop(self) -> None:
        if not self.ended:
            self.ended = True
            _ended.append(self.handle)
        model = self.model()
        if model is not None:
            _watches.pop(model, None)


def _remove_ended_hooks() -> None:
    while _ended:
        _ended.pop().remove()


def watch_untrained(model: nn.Module) -> None:
    """Warn once if optimizers step while ``model`` (a QAT model) trains and none holds its parameters."""
    _remove_ended_hooks()
    _watches[model] = _UntrainedWatch(model)


def unwatch(model: nn.Module) -> None:
    """End the watch of ``model`` (converted in place; a converted copy was never watched)."""
    watch = _watches.get(model)
    if watch is not None:
        watch.stop()
    _remove_ended_hooks()
