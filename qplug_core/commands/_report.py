"""The quantization report as the ``quantize`` and ``report`` commands print it."""

from __future__ import annotations

from typing import Any

from qplug_core.commands._common import emit_json, show


def print_report(report: Any, facts: dict[str, Any], as_json: bool) -> None:
    """``facts`` (paths, sizes, versions) first, then the QuantizationReport, as JSON or text."""
    if as_json:
        emit_json({**facts, "report": report.to_dict()})
        return
    from rich.table import Table

    table = Table(show_header=False, box=None)
    for key, value in facts.items():
        text = (", ".join(f"{k} {v}" for k, v in value.items()) if isinstance(value, dict)
                else str(value))
        table.add_row(key.replace("_", " "), text)
    show(table, report)
    skipped = report.skipped
    if skipped:
        detail = Table(title="left in float", title_justify="left")
        for column in ("node", "op", "reason"):
            detail.add_column(column, overflow="fold")
        for entry in skipped:
            detail.add_row(entry.node, entry.op, entry.reason)
        show(detail)
