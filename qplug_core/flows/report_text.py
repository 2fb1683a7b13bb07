"""A QuantizationReport as text a user reads top-down: the int8 share, then what stayed float.

Every line fits :data:`WIDTH` columns (names too long for a line are wrapped, never allowed to
push a line wider). Float ops are grouped by reason, compute ops only; shape and integer plumbing
is one line with the most frequent op names, unless ``verbose`` lists every node.
"""

from __future__ import annotations

import textwrap
from collections import Counter
from typing import TYPE_CHECKING

from qplug_core.flows.op_kinds import COMPUTE, base_name

if TYPE_CHECKING:
    from rich.text import Text

    from qplug_core.flows.report import QuantizationReport, SkippedNode

#: the width every line of the summary fits in
WIDTH = 80
#: op names shown in a one-line count ("layer_norm 5, add 4, ... +3 more")
TOP_OPS = 5


def _wrap(text: str, width: int, indent: str = "", hang: str = "") -> list[str]:
    return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=hang or indent,
                         break_long_words=True, break_on_hyphens=False) or [indent.rstrip()]


def op_counts(entries: list[SkippedNode], top: int = TOP_OPS) -> str:
    """``"layer_norm 5, add 4, softmax 2 (+3 more)"``: the most frequent op names first."""
    counts = Counter(base_name(entry.op) for entry in entries).most_common()
    listed = ", ".join(f"{op} {n}" for op, n in counts[:top])
    return listed + (f" (+{len(counts) - top} more)" if len(counts) > top else "")


def by_reason(entries: list[SkippedNode]) -> list[tuple[str, list[SkippedNode]]]:
    """``entries`` grouped by reason, the largest group first (ties in first-seen order)."""
    groups: dict[str, list[SkippedNode]] = {}
    for entry in entries:
        groups.setdefault(entry.reason, []).append(entry)
    return sorted(groups.items(), key=lambda item: -len(item[1]))


def split_plumbing(report: QuantizationReport) -> tuple[list[SkippedNode], list[SkippedNode]]:
    """(compute ops left in float, shape and integer ops) of ``report.skipped``."""
    compute = [s for s in report.skipped if getattr(s, "kind", COMPUTE) == COMPUTE]
    return compute, [s for s in report.skipped if getattr(s, "kind", COMPUTE) != COMPUTE]


def int8_share_line(report: QuantizationReport) -> str:
    """``int8: 12 regions, 19 compute ops left in float (39% int8)``, the answer in one line."""
    compute, _ = split_plumbing(report)
    regions = len(report.quantized)
    total = regions + len(compute)
    share = f" ({regions / total:.0%} int8)" if total else ""
    return (f"int8: {regions} region(s), {len(compute)} compute op(s) left in float{share}")


def _kernel_lines(report: QuantizationReport, width: int) -> list[str]:
    lines = []
    if report.kernels:
        kernels = Counter(report.kernels.values()).most_common()
        lines += _wrap(f"on backend kernels: {len(report.kernels)} ("
                       + ", ".join(f"{k} {n}" for k, n in kernels) + ")", width, "  ", "    ")
    if report.reference:
        reasons = Counter(report.reference.values()).most_common()
        lines += _wrap(f"reference form (no kernel): {len(report.reference)}", width, "  ")
        for reason, n in reasons[:3]:
            lines += _wrap(f"{n:>3}  {reason}", width, "    ", "         ")
    if report.fusions:
        kinds = Counter(f.fused_type for f in report.fusions).most_common()
        lines += _wrap(f"fusions: {len(report.fusions)} ("
                       + ", ".join(f"{k} {n}" for k, n in kinds) + ")", width, "  ", "    ")
    if report.partitions:
        modules = Counter(p["module"] for p in report.partitions).most_common()
        lines += _wrap(f"compiled partitions: {len(report.partitions)} ("
                       + ", ".join(f"{m} {n}" for m, n in modules) + f"), {len(report.outside)} "
                       "node(s) left in PyTorch", width, "  ", "    ")
    return lines


def _float_lines(report: QuantizationReport, width: int, verbose: bool) -> list[str]:
    compute, plumbing = split_plumbing(report)
    lines = []
    if compute:
        lines.append(f"left in float: {len(compute)} compute op(s), by reason")
        for reason, entries in by_reason(compute):
            lines += _wrap(f"{len(entries):>4}  {reason}", width, "", "      ")
            detail = (", ".join(f"{e.node} ({e.op})" for e in entries) if verbose
                      else op_counts(entries))
            lines += _wrap(detail, width, "      ")
    if plumbing:
        if verbose:
            lines.append(f"shape and integer ops: {len(plumbing)} (no int8 gain)")
            for reason, entries in by_reason(plumbing):
                lines += _wrap(f"{len(entries):>4}  {reason}", width, "", "      ")
                lines += _wrap(", ".join(f"{e.node} ({e.op})" for e in entries), width, "      ")
        else:
            lines += _wrap(f"+ {len(plumbing)} shape and integer op(s), no int8 gain: "
                           f"{op_counts(plumbing, 3)}; --verbose lists them", width, "", "  ")
    return lines


def report_lines(report: QuantizationReport, *, verbose: bool = False,
                 width: int = WIDTH) -> list[str]:
    """The report as lines of at most ``width`` columns, the int8 share first."""
    head = f"qplug quantization report: backend {report.backend}, {report.mode}, {report.capture} capture"
    return [*_wrap(head, width), *_wrap(int8_share_line(report), width),
            *_kernel_lines(report, width), *_float_lines(report, width, verbose)]


def report_text(report: QuantizationReport, *, verbose: bool = False, width: int = WIDTH) -> Text:
    """:func:`report_lines` as one rich Text (what ``rich.print(report)`` shows)."""
    from rich.text import Text

    return Text("\n".join(report_lines(report, verbose=verbose, width=width)))
