"""The quantization report as the ``quantize`` and ``report`` commands print it."""

from __future__ import annotations

from typing import Any

from qplug_core.cli._common import emit_json


def print_report(report: Any, facts: dict[str, Any], as_json: bool, verbose: bool = False) -> None:
    """One JSON document (facts and the whole report), or the summary that leads with accuracy."""
    if as_json:
        emit_json({**facts, "report": report.to_dict()})
        return
    from qplug_core.cli._summary import print_summary

    print_summary(report, facts, verbose=verbose)


def print_swapped(facts: dict[str, Any], as_json: bool) -> None:
    """A module-swap model's facts (no graph report): one JSON document, or the summary."""
    if as_json:
        emit_json(facts)
        return
    from qplug_core.cli._summary import print_facts

    print_facts(f"qplug quantization report: {facts['mode']}, quantized by module swap", facts)
