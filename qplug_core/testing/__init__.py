"""Test support for qplug and for third-party backend authors (see :mod:`.pattern_cases`)."""

from qplug_core.testing.environment import all_plugins_loaded, one_thread, require_distribution
from qplug_core.testing.pattern_cases import (
    OutputCheck,
    PatternCase,
    PatternResult,
    case_id,
    cases_for,
    check_pattern,
)

__all__ = ["OutputCheck", "PatternCase", "PatternResult", "all_plugins_loaded", "case_id", "cases_for",
           "check_pattern", "one_thread", "require_distribution"]
