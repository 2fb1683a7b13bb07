"""AWQ (Lin et al. 2023, activation-aware weight quantization) for one linear layer at a time.

Weights that meet large activations matter most. AWQ scales input feature ``j`` of ``W`` by
``s_j = mean|x_j| ** alpha`` before rounding, so those weights get finer steps, and divides the
activation by ``s`` (here ``input_scale = 1 / s``, applied by the quantized module, instead of
being folded into the previous layer: any model works, at the cost of one elementwise product).
``alpha`` is searched on a grid against the layer's output error on calibration inputs, and then
each group's range is clipped where that lowers the output error (AWQ's clip search). ``alpha = 0``
and no clip is RTN, so on the calibration data AWQ is never worse than RTN.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from qplug_core.errors import CalibrationError
from qplug_core.kernels.weight_only_scheme import QuantizedWeight, WeightOnlyScheme, quantize
from qplug_core.weight_only.batches import run_batch

ALPHAS = tuple(i / 20 for i in range(21))
CLIP_RATIOS = tuple(1.0 - i / 20 for i in range(11))  # 1.0 .. 0.5
#: calibration rows kept per layer (evenly spaced over all the batches): AWQ's search needs few,
#: GPTQ's Hessian wants more rows than input features (measured on MiniLM: 512 -> 4096 rows
#: raised its int4 cosine from 0.986 to 0.990)
MAX_ROWS = 512
GPTQ_ROWS = 4096
#: rows used by the clip search, and output rows it processes at once (bounds its memory)
CLIP_ROWS = 128
_CLIP_CHUNK = 256


def record_inputs(model: nn.Module, layers: dict[str, nn.Module], calibration: Iterable[Any],
                  max_rows: int = MAX_ROWS) -> dict[str, torch.Tensor]:
    """Run ``model`` on every calibration batch and keep up to ``max_rows`` input rows per layer."""
    rows: dict[str, list[torch.Tensor]] = {name: [] for name in layers}

    def hook(name: str):
        def record(module, args):
            rows[name].append(args[0].detach().reshape(-1, args[0].shape[-1]).float())
        return record

    handles = [module.register_forward_pre_hook(hook(name)) for name, module in layers.items()]
    batches = 0
    try:
        with torch.no_grad():
            for batch in calibration:
                run_batch(model, batch, batches)
                batches += 1
    finally:
        for handle in handles:
            handle.remove()
    if not batches:
        raise CalibrationError("the data-aware algorithms need calibration data: pass "
                               "calibration=[batch, ...] (token id tensors, or dicts of model inputs)")
    kept = {}
    for name, chunks in rows.items():
        if not chunks:
            continue  # a layer the calibration never reached is quantized with RTN
        x = torch.cat(chunks)
        if x.shape[0] > max_rows:
            x = x[torch.linspace(0, x.shape[0] - 1, max_rows).long()]
        kept[name] = x
    return kept


def awq_quantize(weight: torch.Tensor, x: torch.Tensor,
                 scheme: WeightOnlyScheme) -> tuple[QuantizedWeight, torch.Tensor]:
    """Quantize ``weight`` ``[N, K]`` for inputs like ``x`` ``[T, K]``; returns it with ``1 / s`` in the
    weight's dtype."""
    w = weight.detach().float()
    reference = x @ w.T
    activation = x.abs().mean(0).clamp(min=1e-8)
    best_error, s = float("inf"), torch.ones_like(activation)
    for alpha in ALPHAS:
        candidate = activation.pow(alpha)
        candidate = candidate / (candidate.max() * candidate.min()).sqrt()
        effective = quantize(w * candidate, scheme).dequantize() / candidate
        error = float(((x @ effective.T - reference) ** 2).mean())
        if error < best_error:
            best_error, s = error, candidate
    # 1 / s in the model's dtype (a float32 scale would turn a bf16/fp16 model's activations float32),
    # and the weight scaled by exactly what the activation is divided by
    inverse = (1 / s).to(weight.dtype)
    s = 1 / inverse.float()
    clip = _search_clip(w * s, x[: CLIP_ROWS] / s, scheme)
    return quantize(w * s, scheme, clip), inverse.contiguous()


def _search_clip(w: torch.Tensor, x: torch.Tensor, scheme: WeightOnlyScheme) -> torch.Tensor:
    """Per (output row, group): the clip ratio minimising that group's share of the output error."""
    n, k = w.shape
    groups = scheme.groups(k)
    size = k // groups
    xg = x.view(-1, groups, size)
    best_ratio = torch.ones(n, groups)
    for start in range(0, n, _CLIP_CHUNK):
        rows = w[start:start + _CLIP_CHUNK]
        best_error = torch.full((rows.shape[0], groups), float("inf"))
        chosen = best_ratio[start:start + _CLIP_CHUNK]
        for ratio in CLIP_RATIOS:
            clip = torch.full((rows.shape[0], groups), ratio)
            delta = (quantize(rows, scheme, clip).dequantize() - rows).view(-1, groups, size)
            error = torch.einsum("tgs,ngs->tng", xg, delta).pow(2).mean(0)
            better = error < best_error
            best_error = torch.where(better, error, best_error)
            chosen[better] = ratio
    return best_ratio
