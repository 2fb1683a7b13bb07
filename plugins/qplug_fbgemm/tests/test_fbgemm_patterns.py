"""Every pattern config of fbgemm, quantized end to end and compared with the reference backend."""

from qplug_core.plugin_api import BackendPatternSuite


class TestFbgemmPatterns(BackendPatternSuite):
    backend = "fbgemm"
    distribution = "qplug-fbgemm"
