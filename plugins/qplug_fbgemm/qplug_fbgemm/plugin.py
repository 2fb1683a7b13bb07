"""The ``fbgemm`` backend (entry point ``qplug: fbgemm = qplug_fbgemm.plugin:plugin``).

FBGEMM is the x86 int8 library behind ``torch.ops.quantized`` (engine ``fbgemm``). It runs the
shared pattern set with torch's native dtype configs (the :class:`BackendPlugin` defaults) on the
core's torch int8 kernels packed for its engine. The core derives CPU-safe qparams from the
engine's arithmetic (u8 x s8 pair sums in int16 without VNNI: 7-bit weights there, full 8-bit with
VNNI) and warns about user qconfigs that saturate; what is its own is the pass that keeps the
depthwise kernels (int16 pair sums on every CPU) from saturating, and their refusal of qparams that
would saturate them (a model quantized for another backend); and packing depthwise and small-group
Conv1d for torch's oneDNN engine, whose kernels for them are 10-50x faster than fbgemm's generic
grouped path (``grouped_conv1d.py``).
"""

from __future__ import annotations

from typing import Any, Callable

from qplug_core.plugin_api import X86_MACHINES, BackendPlugin, Int8Arithmetic, KernelSpec, Stage

from qplug_fbgemm.grouped_conv1d import on_onednn_where_faster
from qplug_fbgemm.kernels import refusing_saturating_depthwise, with_context_step
from qplug_fbgemm.passes import limit_depthwise_input_range


class FbgemmPlugin(BackendPlugin):
    name = "fbgemm"
    description = "x86 int8 kernels (FBGEMM: AVX2, AVX-512, VNNI)"
    engine = "fbgemm"
    machines = preferred_machines = X86_MACHINES
    #: vpmaddubsw without VNNI: the core makes the default weights 7-bit there
    int8_arithmetic = Int8Arithmetic.U8S8_INT16_PAIRS_WITHOUT_VNNI

    def qconfig_options(self, mode: str) -> dict[str, Any]:
        return {"per_channel": True, "per_channel_conv_transpose": False}

    def kernels(self) -> dict[Any, KernelSpec]:
        return with_context_step(refusing_saturating_depthwise(super().kernels()), on_onednn_where_faster)

    def passes(self, stage: str) -> list[Callable]:
        return [limit_depthwise_input_range] if stage == Stage.POST_PREPARE else []


plugin = FbgemmPlugin()
