"""The ``fbgemm`` backend (entry point ``qplug: fbgemm = qplug_fbgemm.plugin:plugin``).

FBGEMM is the x86 int8 library behind ``torch.ops.quantized`` (engine ``fbgemm``). It runs the
shared pattern set with torch's native dtype configs (the :class:`BackendPlugin` defaults) on the
core's torch int8 kernels packed for its engine; what is its own is the CPU-dependent activation
range and the passes that keep FBGEMM's int16 pair sums from saturating.
"""

from __future__ import annotations

from typing import Any, Callable

from qplug_core.plugin_api import X86_MACHINES, BackendPlugin, Diagnostic, Stage

from qplug_fbgemm import cpu
from qplug_fbgemm.passes import limit_depthwise_input_range, warn_full_range_without_vnni


class FbgemmPlugin(BackendPlugin):
    name = "fbgemm"
    description = "x86 int8 kernels (FBGEMM: AVX2, AVX-512, VNNI)"
    engine = "fbgemm"
    machines = preferred_machines = X86_MACHINES

    def qconfig_options(self, mode: str) -> dict[str, Any]:
        # Without VNNI, vpmaddubsw adds u8 x s8 pairs into int16 with saturation (255 * 127 * 2 >
        # 32,767); 7-bit activations keep a pair within 32,512. VNNI accumulates in int32.
        return {"reduce_range": not cpu.has_vnni(), "per_channel": True,
                "per_channel_conv_transpose": False}

    def passes(self, stage: str) -> list[Callable]:
        return [limit_depthwise_input_range, warn_full_range_without_vnni] \
            if stage == Stage.POST_PREPARE else []

    def check_environment(self) -> list[Diagnostic]:
        if cpu.has_vnni():
            return [Diagnostic("ok", "CPU has VNNI: 8-bit activations are safe with fbgemm")]
        return [Diagnostic("warning", "CPU lacks VNNI: fbgemm's int16 pair sums can saturate with "
                                      "8-bit activations", hint="keep the plugin's default reduce_range=True")]


plugin = FbgemmPlugin()
