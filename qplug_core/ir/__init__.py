"""The graph IR: torch.fx GraphModules captured at module level or ATen level."""

from __future__ import annotations

from qplug_core.ir.capture import QplugTracer, capture_aten, capture_module

__all__ = ["QplugTracer", "capture_aten", "capture_module"]
