"""The CPU capability probe the plugin reads (the core's, ``plugin_api.has_vnni``): without VNNI,
FBGEMM's ``vpmaddubsw`` saturates int16 pair sums of u8 x s8 products, so the plugin defaults to
``reduce_range=True`` there. Tests monkeypatch :func:`has_vnni` here (or call :func:`cpu_flags`).
"""

from __future__ import annotations

from qplug_core.plugin_api import VNNI_FLAGS, cpu_flags, has_vnni

__all__ = ["VNNI_FLAGS", "cpu_flags", "has_vnni"]
