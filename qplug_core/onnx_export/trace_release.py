"""Let go of what torch's exporter and onnxscript keep of the last graph they worked on.

Two module-level holders kept a delegated model's exported weights alive after the model was
deleted, until the process exported something else:

- ``torch.export`` (non-strict, which torch.onnx uses) records after every trace a map from its
  fake tensors to the traced graph's nodes
  (``torch.fx.experimental.proxy_tensor._FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT``), read only
  while an export runs (its fake-tensor leak detection) and cleared only by the next trace;
- each of onnxscript's default rewrite rules (run by the exporter's optimizer) keeps, in its
  matcher, the last ONNX graph it matched, whose initializers are the weights.

Both are cleared after each of our exports. Where another torch or onnxscript keeps no such
state, there is nothing to clear.
"""

from __future__ import annotations

_TORCH_MAP = "_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT"
#: a matcher's state of its last match (the graph, the node, the tracer, the result)
_MATCH_STATE = ("_graph", "_current_node", "_tracer", "_match")


def forget_last_trace() -> None:
    """Clear torch.export's map of the last traced graph and the rewrite rules' last match."""
    from torch.fx.experimental import proxy_tensor

    nodes = getattr(proxy_tensor, _TORCH_MAP, None)
    if isinstance(nodes, dict):
        nodes.clear()
    try:
        import onnxscript.rewriter as rewriter
    except ImportError:  # no onnxscript: torch.onnx.export failed before anything was kept
        return
    for rule in getattr(rewriter, "_DEFAULT_REWRITE_RULES", ()):
        state = getattr(getattr(rule, "_matcher", None), "__dict__", {})
        for name in _MATCH_STATE:
            if name in state:
                state[name] = None


__all__ = ["forget_last_trace"]
