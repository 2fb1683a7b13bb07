"""The graph IR: torch.fx GraphModules captured at module level or ATen level."""

from __future__ import annotations

from qplug_core.ir import fx_attribute_names
from qplug_core.ir.capture import QplugTracer, capture_aten, capture_module

fx_attribute_names.install()  # before any graph of a model with a submodule named "class" is coded

__all__ = ["QplugTracer", "capture_aten", "capture_module"]
