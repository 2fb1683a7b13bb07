"""Every pattern config of qnnpack, quantized end to end and compared with the reference backend."""

from qplug_core.plugin_api import BackendPatternSuite


class TestQnnpackPatterns(BackendPatternSuite):
    backend = "qnnpack"
    distribution = "qplug-qnnpack"
