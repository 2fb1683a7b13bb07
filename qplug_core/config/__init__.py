"""Configs as plain data: qconfigs, qconfig mappings and backend configs.

Every object here validates when built, raises :mod:`qplug_core.errors` types naming the bad field,
and round-trips through ``to_dict()`` -> JSON -> ``from_dict()``. Names follow
``torch.ao.quantization`` so that code migrates by changing an import.
"""

from __future__ import annotations

from qplug_core.config.backend_config import BackendConfig
from qplug_core.config.codec import SCHEMA_VERSION
from qplug_core.config.dtypes import DTypeConfig, DTypeWithConstraints
from qplug_core.config.names import (
    decode_name,
    encode_name,
    register_serializable,
    register_serializable_module,
)
from qplug_core.config.pattern_config import BackendPatternConfig, ObservationType
from qplug_core.config.qconfig import QConfig
from qplug_core.config.qconfig_mapping import QConfigMapping

__all__ = [
    "SCHEMA_VERSION",
    "BackendConfig",
    "BackendPatternConfig",
    "DTypeConfig",
    "DTypeWithConstraints",
    "ObservationType",
    "QConfig",
    "QConfigMapping",
    "decode_name",
    "encode_name",
    "register_serializable",
    "register_serializable_module",
]
