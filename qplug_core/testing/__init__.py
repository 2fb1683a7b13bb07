"""Test support for qplug and for third-party backend authors (see :mod:`.pattern_cases`).

Names are imported on first use: pytest loads :mod:`.pytest_plugin` (a ``pytest11`` entry point)
in every test session of an environment where qplug-core is installed, and importing this package
must not import torch and the pipeline into test sessions that never use qplug.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the lazy names, for type checkers and IDEs
    from qplug_core.testing.environment import all_plugins_loaded, one_thread, require_distribution
    from qplug_core.testing.pattern_cases import (
        OutputCheck,
        PatternCase,
        PatternResult,
        case_id,
        cases_for,
        check_pattern,
    )

_EXPORTS = {
    "all_plugins_loaded": "qplug_core.testing.environment", "one_thread": "qplug_core.testing.environment",
    "require_distribution": "qplug_core.testing.environment",
    "OutputCheck": "qplug_core.testing.pattern_cases", "PatternCase": "qplug_core.testing.pattern_cases",
    "PatternResult": "qplug_core.testing.pattern_cases", "case_id": "qplug_core.testing.pattern_cases",
    "cases_for": "qplug_core.testing.pattern_cases", "check_pattern": "qplug_core.testing.pattern_cases",
}

__all__ = ["OutputCheck", "PatternCase", "PatternResult", "all_plugins_loaded", "case_id", "cases_for",
           "check_pattern", "one_thread", "require_distribution"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'qplug_core.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
