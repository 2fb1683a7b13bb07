"""Let go of what torch's exporter keeps of the last graph it traced.

``torch.export`` (non-strict, which torch.onnx uses) records, after every trace, a module-level
map from its fake tensors to the traced graph's nodes
(``torch.fx.experimental.proxy_tensor._FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT``), cleared only
by the next trace. Those nodes reach the graph module the trace built, and with it the
partition's int8 weights: a delegated model's weights outlived the model until the process
exported something else. The map is only read while an export runs (its fake-tensor leak
detection), so clearing it after our export is safe. Where another torch keeps no such map,
there is nothing to clear.
"""

from __future__ import annotations

_MAP = "_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT"


def forget_last_trace() -> None:
    """Clear torch.export's map of the last traced graph's nodes (idempotent)."""
    from torch.fx.experimental import proxy_tensor

    nodes = getattr(proxy_tensor, _MAP, None)
    if isinstance(nodes, dict):
        nodes.clear()


__all__ = ["forget_last_trace"]
