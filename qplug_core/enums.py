"""The small vocabularies shared by the flows, the hooks and the CLI, as ``str`` enums.

A leaf module (it imports nothing from qplug) so that configs, defaults, the registry and plugins
can all name a mode or a stage without importing each other. Members compare equal to their
values, so ``mode == "static"`` and ``"qat" in MODES`` keep working.
"""

from __future__ import annotations

from enum import Enum


class _Vocabulary(str, Enum):
    """Prints (and formats) as its value: ``f"{Mode.STATIC}" == "static"``."""

    def __str__(self) -> str:
        return str(self.value)


class Mode(_Vocabulary):
    """The quantization workflow a qconfig mapping is for."""

    STATIC = "static"
    QAT = "qat"
    DYNAMIC = "dynamic"


class Stage(_Vocabulary):
    """The points in the flows where plugin passes (``qplug_passes``) run."""

    PRE_FUSE = "pre_fuse"
    POST_PREPARE = "post_prepare"
    PRE_CONVERT = "pre_convert"
    POST_CONVERT = "post_convert"


class BackendStatus(_Vocabulary):
    """A backend's row in ``qplug list-backends``."""

    OK = "ok"
    UNAVAILABLE = "unavailable"
    BROKEN = "broken"
    CONFLICT = "conflict"


class PluginStatus(_Vocabulary):
    """A plugin's row in ``qplug plugins``."""

    OK = "ok"
    BROKEN = "broken"
    CONFLICT = "conflict"
    DISABLED = "disabled"
    INCOMPATIBLE = "incompatible"


#: the values, for messages and ``did_you_mean``
MODES: tuple[str, ...] = tuple(m.value for m in Mode)
STAGES: tuple[str, ...] = tuple(s.value for s in Stage)

__all__ = ["MODES", "STAGES", "BackendStatus", "Mode", "PluginStatus", "Stage"]
