"""torch.ao's QAT switches, as migrated code passes them to ``model.apply``, met by qplug's modules.

``model.apply(torch.ao.quantization.disable_observer)`` (or ``enable_observer``,
``disable_fake_quant``, ``enable_fake_quant``) and ``model.apply(torch.ao.nn.intrinsic.qat.freeze_bn_stats)``
(or ``update_bn_stats``) act only on torch.ao's own classes (``isinstance`` of torch.ao's
``FakeQuantizeBase``, ``type(mod) in {ConvBn2d, ...}``): on qplug's fake quants and QAT modules they did
nothing, without a word, and QAT went on observing after the "freeze". ``nn.Module.apply`` calls
``child.apply(fn)`` on every child, so a qplug module that overrides ``apply`` sees the helper and
runs its own namesake instead. The helpers are recognised by their qualified names: runtime code
does not import torch.ao.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

from torch import nn

#: where torch.ao defines its observer / fake-quant switches and its BN switches
TORCH_AO_FAKE_QUANTIZE = "torch.ao.quantization.fake_quantize"
TORCH_AO_CONV_FUSED = "torch.ao.nn.intrinsic.qat.modules.conv_fused"


def qualified_name(fn: Any) -> str:
    """``module.qualname`` of a function (what identifies torch.ao's helpers without importing them)."""
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}"


class AnswersTorchAoApply:
    """Mixin for ``nn.Module`` subclasses: ``apply`` swaps a torch.ao switch for qplug's twin.

    Subclasses set ``TORCH_AO_TWINS``: torch.ao helper's qualified name -> qplug's function for
    ``model.apply``. The twin runs on the module and its children, as the helper would have.
    """

    TORCH_AO_TWINS: ClassVar[dict[str, Callable[[nn.Module], None]]] = {}

    def apply(self, fn: Callable[[nn.Module], None]) -> Any:
        twin = self.TORCH_AO_TWINS.get(qualified_name(fn), fn)
        return super().apply(twin)  # type: ignore[misc]
