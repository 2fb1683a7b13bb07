"""A model torch.ao already prepared or quantized, handed to qplug: refused by name, up front.

Migrations go step by step, so a helper still calling torch.ao's ``prepare_fx`` / ``convert_fx``
feeds qplug a model holding torch.ao's observers or int8 modules. qplug accepted it at prepare,
calibrated it and then failed in convert with a torch.fx message ("references nonexistent
attribute activation_post_process_0"), or called it "a model with no observers". The classes are
recognised by their module path: runtime code does not import torch.ao.
"""

from __future__ import annotations

from torch import nn

from qplug_core.errors import ModelStateError

#: module paths of torch.ao's classes that only a torch.ao prepare or convert puts in a model
_OBSERVED = ("torch.ao.quantization.observer", "torch.ao.quantization.fake_quantize",
             "torch.ao.nn.qat.", "torch.ao.nn.intrinsic.qat.")
_QUANTIZED = ("torch.ao.nn.quantized.", "torch.ao.nn.intrinsic.quantized.", "torch.ao.nn.sparse.quantized.")
#: float helpers that live among torch.ao's int8 modules: a float model written for torch.ao's
#: eager mode holds them (its skip adds), and qplug quantizes it like any other
_FLOAT_HELPERS = frozenset({"FloatFunctional", "FXFloatFunctional"})


def _held(model: nn.Module, prefixes: tuple[str, ...]) -> list[str]:
    found = []
    for name, module in model.named_modules():
        cls = type(module)
        if cls.__module__.startswith(prefixes) and cls.__name__ not in _FLOAT_HELPERS:
            found.append(f"{name or '<model>'}: {cls.__module__}.{cls.__qualname__}")
    return found


def refuse_torch_ao_models(model: nn.Module) -> None:
    """Raise :class:`ModelStateError` if ``model`` holds torch.ao's int8 modules or its observers,
    fake quants or QAT modules, naming the first few and what to do instead."""
    for held, kind, fix in (
            (_held(model, _QUANTIZED), "quantized by torch.ao (it holds torch.ao's int8 modules",
             "quantize the original float model with qplug"),
            (_held(model, _OBSERVED), "prepared by torch.ao (it holds torch.ao's observers, fake quants or QAT modules",
             "qplug cannot calibrate or convert them: prepare the original float model with "
             "qp.prepare_fx (qp.prepare_qat_fx for QAT)")):
        if held:
            more = f" and {len(held) - 3} more" if len(held) > 3 else ""
            raise ModelStateError(f"this model was {kind}: {', '.join(held[:3])}{more}); {fix}. "
                                  "docs/migrating.md maps torch.ao's calls to qplug's")
