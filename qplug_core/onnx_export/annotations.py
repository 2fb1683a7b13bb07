"""The notes torch.onnx writes into a model for a person reading it, left out of partition models.

torch.onnx annotates every node with ``metadata_props`` (its FX node, module path, class hierarchy
and the Python stack trace that made it) and the graph with ``value_info`` (the type and shape of
every intermediate value). No runtime needs them, and they were most of a small partition's
model: a 4-block TCN's 206 kB held 121 kB of node notes and 15 kB of value_info beside 27 kB of
int8 weights, stored in a ``qp.save`` file once per compiled input signature. ``QPLUG_DEBUG=1``
keeps them (which node of the model a runtime's error names, and where it came from).
"""

from __future__ import annotations

import os
from typing import Any


def strip_annotations(proto: Any) -> None:
    """Remove the node notes, doc strings and ``value_info`` of ``proto`` (an ``onnx.ModelProto``)
    in place, subgraphs (a Loop's body) and functions included, unless ``QPLUG_DEBUG=1``; the
    model's own ``metadata_props`` (qplug's input sizes) stay."""
    if os.environ.get("QPLUG_DEBUG") == "1":  # as the CLI keeps tracebacks
        return
    proto.doc_string = ""
    _strip_graph(proto.graph)
    for function in proto.functions:
        function.doc_string = ""
        _strip_nodes(function.node)


def _strip_graph(graph: Any) -> None:
    graph.doc_string = ""
    del graph.value_info[:]
    _strip_nodes(graph.node)


def _strip_nodes(nodes: Any) -> None:
    for node in nodes:
        node.doc_string = ""
        del node.metadata_props[:]
        for attribute in node.attribute:
            for graph in (*([attribute.g] if attribute.HasField("g") else []), *attribute.graphs):
                _strip_graph(graph)
