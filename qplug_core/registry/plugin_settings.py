"""A plugin's own settings changed by name (``qplug_onnxruntime.configure(num_threads=2)``).

``dataclasses.replace`` refuses an unknown name with a ``TypeError`` from the dataclass's
``__init__`` ("CompileSettings.__init__() got an unexpected keyword argument 'num_thread'"), a
class the user never wrote; this names the setting, its likely spelling and the settings there are.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from qplug_core.errors import ConfigValidationError, did_you_mean

__all__ = ["replaced_settings"]

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
