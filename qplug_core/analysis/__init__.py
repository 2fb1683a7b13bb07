"""Looking at a quantized model from outside the pipeline: numeric comparison against float and
where each op of a model would run on a backend."""

from qplug_core.analysis.backend_splits import BackendSplit, by_backend
from qplug_core.analysis.compare import compare
from qplug_core.analysis.layers import LayerComparison, sqnr

__all__ = ["BackendSplit", "LayerComparison", "by_backend", "compare", "sqnr"]
