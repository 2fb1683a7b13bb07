"""The quantization report as the ``quantize`` and ``report`` commands print it."""

from __future__ import annotations

from typing import Any

from qplug_core.cli._accuracy import accuracy_line, worst_layers_table
from qplug_core.cli._common import emit_json
from qplug_core.cli._table import new_table, show


def print_report(report: Any, facts: dict[str, Any], as_json: bool) -> None:
    """``facts`` (paths, sizes, versions, accuracy) first, then the QuantizationReport."""
    if as_json:
        emit_json({**facts, "report": report.to_dict()})
        return
    accuracy = facts.get("accuracy")
    table = new_table("", "", show_header=False)
    for key, value in facts.items():
        if key == "accuracy":
            continue
        text = (", ".join(f"{k} {v}" for k, v in value.items()) if isinstance(value, dict)
                else str(value))
        table.add_row(key.replace("_", " "), text)
    show(table, report)
    if report.skipped:
        detail = new_table("node", "op", "reason", title="left in float")
        for entry in report.skipped:
            detail.add_row(entry.node, entry.op, entry.reason)
        show(detail)
    if accuracy:
        show(accuracy_line(accuracy), worst_layers_table(accuracy))
