"""Depthwise and small-group Conv1d are packed for torch's oneDNN engine, not fbgemm's.

torch runs a quantized conv1d as a 2-D conv with a (1, k) kernel. FBGEMM's depthwise fast path
covers 2-D 3x3/5x5 and 3-D 3x3x3 only, so a Conv1d with few channels per group falls to its generic
grouped path, one tiny GEMM per group: a Conformer's depthwise k=15 at 144 x 200 took 19 ms against
1.4 ms in float (measured on Zen 4, VNNI). oneDNN runs the same packed weights at 0.4 ms, on VNNI and
limited to AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``). Its depthwise kernel sums in int32 on both; its
grouped one sums u8 x s8 pairs in int16 without VNNI, so there a grouped conv whose pairs can leave
int16 keeps fbgemm's kernel (the core's 7-bit weights on such CPUs keep them within). oneDNN takes
symmetric weights only (zero points 0, fbgemm's default); other weights keep fbgemm's kernel too.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from qplug_core.plugin_api import KernelContext, cpu_int8, engine_availability

from qplug_fbgemm.passes import is_depthwise

#: above this many input channels per group fbgemm's grouped GEMMs are fast (measured: k=15, 144
#: channels: 16 per group fbgemm 0.31 ms vs float 0.47; 8 per group 0.57 vs 0.22)
MAX_CHANNELS_PER_GROUP = 16
INT16_MAX = 32767
ENGINE = "onednn"


def _conv1d(module: nn.Module | None) -> nn.Conv1d | None:
    root = module[0] if isinstance(module, nn.Sequential) and len(module) else module
    return root if type(root) is nn.Conv1d else None


def _pairs_fit_int16(ctx: KernelContext) -> bool:
    activation, weight = ctx.input_qparams[0], ctx.weight_qparams
    return 2 * activation.quant_max * max(-weight.quant_min, weight.quant_max) <= INT16_MAX


def onednn_engine_for(ctx: KernelContext) -> str | None:
    """``"onednn"`` when ``ctx`` is a static Conv1d oneDNN runs faster than fbgemm and exactly, else None."""
    conv = _conv1d(ctx.module)
    if conv is None or conv.groups == 1 or conv.in_channels // conv.groups > MAX_CHANNELS_PER_GROUP:
        return None
    weight = ctx.weight_qparams
    if not ctx.input_qparams or ctx.input_qparams[0].is_dynamic or weight is None \
            or weight.dtype != torch.qint8 or bool(weight.zero_point.ne(0).any()):
        return None
    if not (is_depthwise(conv) or cpu_int8().vnni or _pairs_fit_int16(ctx)):
        return None
    return ENGINE if engine_availability(ENGINE).ok else None


def on_onednn_where_faster(ctx: KernelContext) -> KernelContext:
    """``ctx`` with the oneDNN engine where :func:`onednn_engine_for` says so, else ``ctx``."""
    engine = onednn_engine_for(ctx)
    return ctx if engine is None else dataclasses.replace(ctx, engine=engine)
