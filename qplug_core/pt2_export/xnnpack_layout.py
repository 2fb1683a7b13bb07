"""Say so when ``qp.export_program`` writes an int8 layout ExecuTorch's XNNPACK delegate does not take.

XNNPACK runs per-channel int8 weights only with signed int8 activations (``XNNPACKQuantizer``'s
scheme); its uint8-activation kernels take one weight scale per tensor. qnnpack's default, right
for torch's qnnpack kernels, is uint8 activations with per-channel weights, so such a program's
convs and linears would stay outside the XNNPACK partition. Only the ARM backend's programs are
checked: an fbgemm program of the same layout is what Inductor's x86 lowering matches.
"""

from __future__ import annotations

import torch

from qplug_core.errors import warn_user
from qplug_core.registry.cpu_diagnostics import ARM_FIRST_ENGINES


def warn_if_not_xnnpack_layout(program: torch.export.ExportedProgram, backend: str | None) -> None:
    """Warn if ``program``, exported from a model quantized for ``backend``, is an ARM backend's
    uint8-activation, per-channel-weight program (see the module docstring)."""
    if backend not in ARM_FIRST_ENGINES:  # the qnnpack backend is named after its engine
        return
    targets = [(str(node.target), node.args) for node in program.graph.nodes if node.op == "call_function"]
    per_channel = sum("dequantize_per_channel" in target for target, _ in targets)
    uint8 = any("quantize_per_tensor" in target and any(arg is torch.uint8 for arg in args)
                for target, args in targets)
    if per_channel and uint8:
        warn_user(f"qplug: export_program: this {backend} program has uint8 activations with per-channel int8 "
                  f"weights ({per_channel} layer(s)); ExecuTorch's XNNPACK delegate takes per-channel weights "
                  "only with signed int8 activations, so these layers would run outside it. For a phone, "
                  "trace the model for PyTorch's lite interpreter or use qp.export_onnx (docs/guide/export.md, "
                  "'Deploying to mobile')")


__all__ = ["warn_if_not_xnnpack_layout"]
