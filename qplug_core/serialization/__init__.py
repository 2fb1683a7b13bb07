"""Saving and loading converted models without unpickling: ``qp.save`` / ``qp.load``.

A file holds the model's reference form (int8 weights, qparams, the fx graph as JSON) and the
backend it was converted for; loading rebuilds that form and lowers it with the installed backend,
so no kernel module is ever serialized. See :mod:`qplug_core.serialization.artifact`.
"""

from __future__ import annotations

from qplug_core.serialization.api import load, save
from qplug_core.serialization.artifact import (
    ARTIFACT_KEY,
    Artifact,
    capture_artifact,
    record_artifact,
    record_lowering,
)

__all__ = ["ARTIFACT_KEY", "Artifact", "capture_artifact", "load", "record_artifact", "record_lowering", "save"]
