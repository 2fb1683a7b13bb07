"""Saving and loading converted models without unpickling: ``qp.save`` / ``qp.load``.

A file holds the model's reference form (int8 weights, qparams, the fx graph as JSON) and the
backend it was converted for; loading rebuilds that form and lowers it with the installed backend,
so no kernel module is ever serialized. See :mod:`qplug_core.serialization.artifact`.
"""

from __future__ import annotations

from qplug_core.serialization.api import load, save
from qplug_core.serialization.artifact import Artifact, artifact_of, capture_artifact

__all__ = ["Artifact", "artifact_of", "capture_artifact", "load", "save"]
