"""Layer-by-layer parity of a compiling backend with the reference form (teacher forcing).

The check itself is the one convert runs on delegated partitions of several int8 regions
(:mod:`qplug_core.flows.region_parity`, whose docstring says why region by region); the testing
kit offers it to a backend's own conformance tests as ``plugin_api.layer_parity``.
"""

from __future__ import annotations

from qplug_core.flows.region_parity import LayerParity, RegionParity, layer_parity

__all__ = ["LayerParity", "RegionParity", "layer_parity"]
