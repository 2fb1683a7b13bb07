"""``qp.export_program``: a converted model's reference form as a ``torch.export.ExportedProgram``."""

from qplug_core.pt2_export.program import export_program

__all__ = ["export_program"]
