"""torch.ao's keyword arguments on qplug's entry points: taken where they change nothing or where qplug
does the same, else refused naming qplug's way.

Migrated calls still pass ``prepare_custom_config=``, ``backend_config=None``, ``is_reference=False`` ...
A keyword at torch.ao's default is a no-op and is accepted; a custom config that sets only
``preserved_attributes`` becomes qplug's ``preserved_attributes=``. Any other value changes what torch.ao
would do, and Python's bare ``TypeError: unexpected keyword argument`` would not say what replaces
it: one table holds the answer for each, and :func:`refuses_torch_ao_keywords` checks a call
against the names it lists.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from qplug_core.errors import UnsupportedKeywordError
from qplug_core.flows.preserved_attributes import attribute_names

F = TypeVar("F", bound=Callable[..., Any])

#: torch.ao keyword -> what a qplug call uses instead
TORCH_AO_KEYWORDS: dict[str, str] = {
    "prepare_custom_config": (
        "pass its settings as keywords: set_non_traceable_module_names/classes -> non_traceable_module_names= / "
        "non_traceable_module_classes=; set_preserved_attributes -> preserved_attributes=; "
        "qplug has no standalone modules, custom observed module classes or "
        "input/output quantized indexes"),
    "fuse_custom_config": (
        "qplug's fusion has no custom settings: pass backend= (the backend's fuser methods); "
        "set_preserved_attributes -> preserved_attributes="),
    "convert_custom_config": (
        "qplug's convert has no custom module classes: drop it; set_preserved_attributes -> "
        "preserved_attributes="),
    "backend_config": "pass backend=qp.get_backend(name).with_config(cfg) with a qp.BackendConfig",
    "_equalization_config": (
        "qplug has no input-weight equalization config: qp.quantize(..., recipe=\"smoothquant\") equalizes "
        "activations and weights, recipe=\"equalize\" across layers (docs/guide/accuracy.md)"),
    "is_reference": ("call qp.convert_to_reference_fx(observed) for is_reference=True, "
                     "qp.convert_fx(observed) for is_reference=False"),
    "qconfig_mapping": "convert uses the mapping given to qp.prepare_fx; prepare again to change it",
    "_remove_qconfig": ("qplug's converted modules carry no qconfig attribute to keep: "
                        "qp.quantization_report(model) says what each op got"),
    "keep_original_weights": ("qplug's int8 model keeps no float weights: keep the float model, which "
                              "quantizing never modifies"),
}

#: torch.ao's default of each plain keyword: passing it changes nothing
TORCH_AO_DEFAULTS: dict[str, Any] = {
    "backend_config": None, "_equalization_config": None, "qconfig_mapping": None,
    "is_reference": False, "_remove_qconfig": True, "keep_original_weights": False,
}
_CUSTOM_CONFIGS = ("prepare_custom_config", "fuse_custom_config", "convert_custom_config")


def _custom_settings(config: Any) -> dict[str, Any] | None:
    """The settings a torch.ao custom config (the object, or its dict form) sets, or None for
    anything else. Read through ``to_dict()``, which lists set fields only: no torch.ao import."""
    if config is None:
        return {}
    if not isinstance(config, dict):
        if not (hasattr(config, "preserved_attributes") and callable(getattr(config, "to_dict", None))):
            return None
        config = config.to_dict()
    return {key: value for key, value in config.items() if value}


def _is_default(value: Any, default: Any) -> bool:
    return value is default or (type(value) is type(default) and value == default)


def refuses_torch_ao_keywords(*names: str, defaults: dict[str, Any] | None = None) -> Callable[[F], F]:
    """Take torch.ao's keywords ``names`` at their defaults (``defaults`` overrides
    :data:`TORCH_AO_DEFAULTS` for this function) and custom configs that only preserve attributes
    (passed on as ``preserved_attributes=``); raise :class:`UnsupportedKeywordError` naming qplug's
    equivalent for any other value."""
    answers = {name: TORCH_AO_KEYWORDS[name] for name in names}
    no_ops = {**TORCH_AO_DEFAULTS, **(defaults or {})}

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for name in [name for name in kwargs if name in answers]:
                value = kwargs.pop(name)
                settings = _custom_settings(value) if name in _CUSTOM_CONFIGS else None
                if settings is not None and settings.keys() <= {"preserved_attributes"}:
                    kwargs["preserved_attributes"] = (*attribute_names(kwargs.get("preserved_attributes", ())),
                                                      *attribute_names(settings.get("preserved_attributes", ())))
                    continue
                if name in no_ops and _is_default(value, no_ops[name]):
                    continue
                raise UnsupportedKeywordError(
                    f"{func.__name__}() takes no {name}= (a torch.ao keyword): {answers[name]}. "
                    "docs/migrating.md maps torch.ao's arguments to qplug's", field=name, value=value)
            return func(*args, **kwargs)
        return wrapper  # type: ignore[return-value]
    return decorate
