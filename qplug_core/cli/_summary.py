"""What ``qplug quantize`` and ``qplug report`` print, the answer first, within the terminal width.

Order: how close int8 answers to float (when measured), the int8 share and what stayed float
(``QuantizationReport``'s own text), the facts of the run (paths, sizes, versions), then the
layers int8 hurt most. Nothing is wider than the terminal (80 columns when it is not one).
"""

from __future__ import annotations

import textwrap
from typing import Any

from qplug_core.cli._accuracy import accuracy_line, worst_layers_table
from qplug_core.cli._table import plain, show, terminal_width


def print_summary(report: Any, facts: dict[str, Any], *, verbose: bool = False) -> None:
    """The text form of ``qplug quantize`` / ``qplug report`` on stdout."""
    from qplug_core.flows.report import fact_lines, report_lines

    width = terminal_width()
    accuracy = facts.get("accuracy")
    lines = textwrap.wrap(accuracy_line(accuracy), width, subsequent_indent="    ") if accuracy else []
    lines += report_lines(report, verbose=verbose, width=width)
    lines += fact_lines({k: v for k, v in facts.items() if k != "accuracy"}, width)
    # literal text, controls escaped: names and versions in it come from the file
    show(plain("\n".join(lines)), *([worst_layers_table(accuracy)] if accuracy else []))


def print_facts(title: str, facts: dict[str, Any]) -> None:
    """A report read from a file's facts alone (a module-swap model): accuracy first when measured."""
    from qplug_core.flows.report import fact_lines

    width = terminal_width()
    accuracy = facts.get("accuracy")
    lines = textwrap.wrap(accuracy_line(accuracy), width, subsequent_indent="    ") if accuracy else []
    lines += [title, *fact_lines({k: v for k, v in facts.items() if k != "accuracy"}, width)]
    show(plain("\n".join(lines)), *([worst_layers_table(accuracy)] if accuracy else []))
