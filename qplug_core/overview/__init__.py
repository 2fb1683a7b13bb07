"""What leads a summary of a quantization: the answer first, the plumbing folded.

A transformer captured by torch.export leaves dozens of float nodes that never could have been
int8 (``sym_size``, ``slice``, ``view``, ``expand``, integer mask arithmetic). They stay in
``QuantizationReport.skipped`` (complete data), each marked with its :func:`op_kind`; the text a
user reads counts them in one line and lists, by reason, only the compute ops that could have
run in int8.
"""

from qplug_core.overview.op_kinds import COMPUTE, INTEGER, SHAPE, op_kind

__all__ = ["COMPUTE", "INTEGER", "SHAPE", "op_kind"]
