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
