"""Issue 7: every pattern config of fbgemm, quantized end to end and compared with the reference.

The suite itself lives in :mod:`qplug_core.testing.pattern_suite` (third-party backends reuse it).
"""

from qplug_core.testing.pattern_suite import pattern_suite

globals().update(pattern_suite("fbgemm", "qplug-fbgemm"))
