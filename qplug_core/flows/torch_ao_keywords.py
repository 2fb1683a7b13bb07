"""torch.ao's keyword arguments that qplug's entry points do not take, each answered with qplug's way.

Migrated calls still pass ``prepare_custom_config=``, ``backend_config=``, ``is_reference=`` ...;
Python's bare ``TypeError: unexpected keyword argument`` did not say what replaces them, although
docs/migrating.md knew. One table holds the answer for each; :func:`refuses_torch_ao_keywords`
checks a function's call against the names it lists.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from qplug_core.errors import UnsupportedKeywordError

F = TypeVar("F", bound=Callable[..., Any])

#: torch.ao keyword -> what a qplug call uses instead
TORCH_AO_KEYWORDS: dict[str, str] = {
    "prepare_custom_config": (
        "pass its settings as keywords: set_non_traceable_module_names/classes -> non_traceable_module_names= / "
        "non_traceable_module_classes=; set_preserved_attributes -> set them on the returned model; "
        "qplug has no standalone modules, custom observed module classes or "
        "input/output quantized indexes"),
    "fuse_custom_config": "qplug's fusion has no custom settings: pass backend= (the backend's fuser methods)",
    "convert_custom_config": (
        "qplug's convert has no custom module classes: drop it; for set_preserved_attributes set the "
        "attributes on the returned model"),
    "backend_config": "pass backend=qp.get_backend(name).with_config(cfg) with a qp.BackendConfig",
    "_equalization_config": (
        "qplug has no input-weight equalization config: qp.quantize(..., recipe=\"smoothquant\") equalizes "
        "activations and weights, recipe=\"equalize\" across layers (docs/guide/accuracy.md)"),
    "is_reference": "call qp.convert_to_reference_fx(observed) for is_reference=True",
    "qconfig_mapping": "convert uses the mapping given to qp.prepare_fx; prepare again to change it",
    "preserved_attributes": (
        "qplug's prepared and converted models keep only what forward uses: set the attributes on the "
        "returned model (observed.labels = model.labels)"),
}


def refuses_torch_ao_keywords(*names: str) -> Callable[[F], F]:
    """Raise :class:`UnsupportedKeywordError` naming qplug's equivalent when a call passes one of ``names``."""
    answers = {name: TORCH_AO_KEYWORDS[name] for name in names}

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for name in answers.keys() & kwargs.keys():
                raise UnsupportedKeywordError(
                    f"{func.__name__}() takes no {name}= (a torch.ao keyword): {answers[name]}. "
                    "docs/migrating.md maps torch.ao's arguments to qplug's", field=name, value=kwargs[name])
            return func(*args, **kwargs)
        return wrapper  # type: ignore[return-value]
    return decorate
