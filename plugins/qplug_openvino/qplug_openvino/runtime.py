"""The one place this plugin imports OpenVINO, with its usage telemetry left out.

``import openvino`` sends a "general_import" event through ``openvino_telemetry``, which starts a
thread that forks a process to post it (to Google Analytics, unless the user opted out with
``opt_in_out``). A quantization library has no business sending its users' imports anywhere, and
the fork is not harmless: started from a thread while torch's threads run, the child aborts with
"Fatal Python error: init_threadstate" and its stack dump lands in the user's terminal (it did in
``qplug doctor``). When OpenVINO is not yet imported, this import hides ``openvino_telemetry`` for
its duration, so OpenVINO takes its own no-telemetry stub; an OpenVINO the user imported first is
left as it is.
"""

from __future__ import annotations

import sys
from types import ModuleType

_TELEMETRY = "openvino_telemetry"


def import_openvino() -> ModuleType:
    """``openvino``, imported without its import-time telemetry (see the module docstring)."""
    if "openvino" in sys.modules:
        return sys.modules["openvino"]
    hidden = _TELEMETRY not in sys.modules
    if hidden:
        sys.modules[_TELEMETRY] = None  # type: ignore[assignment]  # makes its import raise ImportError
    try:
        import openvino
    finally:
        if hidden:
            del sys.modules[_TELEMETRY]
    return openvino
