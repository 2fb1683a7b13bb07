"""A one-time warning for a QAT model whose parameters get gradients but never change.

``prepare_qat_fx`` and ``qp.eager.prepare_qat`` return a copy (unless ``inplace=True``); torch.ao's
graph mode reused the float model's parameters, so an optimizer built before prepare worked there.
Here it steps the float model's parameters, and training runs on without moving a weight. The watch
sees exactly that: training-mode forwards that find gradients on the parameters while no parameter
changed (their version counters stand still) since the first one. It stops at the first change, or
after warning once; until then it costs a pass over the parameters per training forward.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from qplug_core.errors import warn_user
from qplug_core.ir.hooks import drop_pre_hooks

#: training forwards with gradients and no change before the warning (gradient accumulation over
#: fewer micro-batches does not trigger it)
PATIENCE = 20


class _UntrainedWatch:
    def __init__(self) -> None:
        self.versions: list[int] | None = None
        self.stale = 0

    def __call__(self, module: nn.Module, args: Any) -> None:
        if not module.training:
            return
        params = [p for p in module.parameters() if p.requires_grad]
        versions = [p._version for p in params]
        if self.versions is None:
            self.versions = versions
            return
        if versions != self.versions:
            self._stop(module)
        elif any(p.grad is not None for p in params):
            self.stale += 1
            if self.stale >= PATIENCE:
                self._stop(module)
                warn_user(
                    f"qplug: this QAT model's parameters received gradients in {PATIENCE} training "
                    "steps, and none of them changed: is the optimizer built on the float model? "
                    "prepare_qat_fx / prepare_qat return a copy, so build the optimizer on the "
                    "returned model (torch.optim.SGD(prepared.parameters(), ...)) or pass inplace=True")

    def _stop(self, module: nn.Module) -> None:
        drop_pre_hooks(module, lambda hook: hook is self)


def watch_untrained(model: nn.Module) -> None:
    """Warn once if ``model`` (a QAT model) trains without its parameters ever changing."""
    model.register_forward_pre_hook(_UntrainedWatch())


def unwatch(model: nn.Module) -> None:
    """Remove the watch (from a converted copy of a QAT model)."""
    drop_pre_hooks(model, lambda hook: isinstance(hook, _UntrainedWatch))
