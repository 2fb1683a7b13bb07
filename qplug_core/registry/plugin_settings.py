"""A plugin's own settings changed by name (``qplug_onnxruntime.configure(num_threads=2)``).

``dataclasses.replace`` refuses an unknown name with a ``TypeError`` from the dataclass's
``__init__`` ("CompileSettings.__init__() got an unexpected keyword argument 'num_thread'"), a
class the user never wrote; this names the setting, its likely spelling and the settings there are.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from qplug_core.errors import ConfigValidationError, did_you_mean

__all__ = ["check_cache_size", "replaced_settings"]

Settings = TypeVar("Settings")


def replaced_settings(settings: Settings, changes: dict[str, Any], owner: str = "configure") -> Settings:
    """A copy of the dataclass ``settings`` with ``changes``; an unknown name is a
    :class:`ConfigValidationError` naming ``owner`` (the function the user called)."""
    names = [field.name for field in dataclasses.fields(settings)]  # type: ignore[arg-type]
    unknown = next((name for name in changes if name not in names), None)
    if unknown is not None:
        raise ConfigValidationError(f"{owner}() has no setting {unknown!r}{did_you_mean(unknown, names)}; its "
                                    f"settings: {', '.join(names)}", field=unknown, value=changes[unknown])
    return dataclasses.replace(settings, **changes)  # type: ignore[type-var]


def check_cache_size(size: Any) -> None:
    """Refuse a ``shape_cache_size`` setting (compiled models a partition keeps) that is not an
    int >= 1."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ConfigValidationError(f"shape_cache_size must be an int >= 1 (compiled models kept per partition), "
                                    f"got {size!r}", field="shape_cache_size", value=size)
