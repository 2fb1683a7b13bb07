"""Test support for qplug and for third-party backend authors (see :mod:`.pattern_cases`)."""

from qplug_core.testing.pattern_cases import (
    OutputCheck,
    PatternCase,
    PatternResult,
    case_id,
    cases_for,
    check_pattern,
)

__all__ = ["OutputCheck", "PatternCase", "PatternResult", "case_id", "cases_for", "check_pattern"]
