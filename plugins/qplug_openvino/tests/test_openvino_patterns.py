"""The plugin testing kit's pattern suite: every pattern config of ``openvino`` gets a generated
model, quantized, compiled into OpenVINO, and compared with its reference form."""

from __future__ import annotations

from qplug_core.plugin_api import BackendPatternSuite


class TestPatterns(BackendPatternSuite):
    backend = "openvino"
    distribution = "qplug-openvino"
