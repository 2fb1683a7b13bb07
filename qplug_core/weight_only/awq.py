"""AWQ (Lin et al. 2023, activation-aware weight quantization) of linear layers.

Weights that meet large activations matter most. AWQ scales input feature ``j`` of ``W`` by
``s_j = mean|x_j| ** alpha`` before rounding, so those weights get finer steps, and divides the
activation by ``s`` (here ``input_scale = 1 / s``, applied by the quantized module, instead of
being folded into the previous layer: any model works, at the cost of one elementwise product).
``alpha`` is searched on a grid against the output error on calibration inputs, one ``s`` for the
linears that read one tensor (q/k/v, gate/up: their joint output error, as in the paper), so they
can still run as one kernel call; then each group's range is clipped where that lowers the output
error (AWQ's clip search). ``alpha = 0`` and no clip is RTN, so on the calibration data AWQ is never
worse than RTN.
"""

from __future__ import annotations

import collections
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
#: output rows of each weight the scale search rounds per candidate (evenly spaced): all 4864 of a
#: Qwen2-0.5B gate/up took 79% of AWQ's time; the error per row is an average, 512 estimate it
SEARCH_ROWS = 512
#: rows used by the clip search, and output rows it processes at once (bounds its memory)
CLIP_ROWS = 128
_CLIP_CHUNK = 256


def record_inputs(model: nn.Module, layers: dict[str, nn.Module], calibration: Iterable[Any],
                  max_rows: int = MAX_ROWS) -> dict[str, torch.Tensor]:
    """Run ``model`` on every calibration batch and keep up to ``max_rows`` input rows per layer
    (:class:`InputRecorder`)."""
    batches = 0
    with InputRecorder(layers) as recorder, torch.no_grad():
        for batch in calibration:
            run_batch(model, batch, batches)
            recorder.next_batch()
            batches += 1
    if not batches:
        raise no_calibration()
    return recorder.kept(max_rows)


def no_calibration() -> CalibrationError:
    """The error of a data-aware algorithm given no calibration batch."""
    return CalibrationError("the data-aware algorithms need calibration data: pass "
                            "calibration_data=[batch, ...] (token id tensors, or dicts of model inputs)")


class InputRecorder:
    """While entered, records the inputs of ``layers`` (name -> module) at each call; :meth:`kept`
    gives up to ``max_rows`` rows per layer, evenly spaced over all the calls.

    Linears that read one tensor (q/k/v, gate/up) share one recording and one kept tensor (they
    held a copy each: 2.8x the linears' own bytes on a decoder), and each input's recorded rows are
    let go as soon as its kept rows are taken; the rows kept are the same as one copy per layer.
    """

    def __init__(self, layers: dict[str, nn.Module]) -> None:
        self._layers = layers
        self._recorded: dict[int, torch.Tensor] = {}  # recording number -> rows of one input tensor
        self._readers: dict[str, list[int]] = {name: [] for name in layers}  # layer -> its recordings
        # this batch: (id, version) -> (tensor, number); the tensor is held, so its id is not reused
        self._seen: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> InputRecorder:
        self._handles = [module.register_forward_pre_hook(self._hook(name)) for name, module in self._layers.items()]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._seen = [], {}

    def _hook(self, name: str) -> Any:
        def record(module: nn.Module, args: tuple) -> None:
            x = args[0]
            key = (id(x), x._version)
            if key not in self._seen:
                self._seen[key] = (x, len(self._recorded))
                self._recorded[len(self._recorded)] = x.detach().reshape(-1, x.shape[-1]).float()
            self._readers[name].append(self._seen[key][1])
        return record

    def next_batch(self) -> None:
        """A new batch starts: a tensor seen before is not the same input any more."""
        self._seen.clear()

    def kept(self, max_rows: int) -> dict[str, torch.Tensor]:
        """Up to ``max_rows`` recorded rows per layer the calls reached (one tensor for the layers
        sharing an input); the recordings are let go."""
        sharing: dict[tuple[int, ...], list[str]] = {}  # a layer the calibration never reached: RTN
        for name, numbers in self._readers.items():
            if numbers:
                sharing.setdefault(tuple(numbers), []).append(name)
        uses = collections.Counter(number for numbers in sharing for number in numbers)
        kept = {}
        for numbers, names in sharing.items():
            x = _evenly_spaced([self._recorded[number] for number in numbers], max_rows)
            kept.update(dict.fromkeys(names, x))
            for number in numbers:
                uses[number] -= 1
                if not uses[number]:
                    del self._recorded[number]
        self._recorded.clear()
        return kept


def _evenly_spaced(chunks: list[torch.Tensor], max_rows: int) -> torch.Tensor:
    """Up to ``max_rows`` rows evenly spaced over ``chunks`` one after the other, copied from each
    chunk (never the whole concatenation first)."""
    total = sum(chunk.shape[0] for chunk in chunks)
    if total <= max_rows:
        return torch.cat(chunks)
    index = torch.linspace(0, total - 1, max_rows).long()
    pieces, start = [], 0
    for chunk in chunks:
        inside = index[(index >= start) & (index < start + chunk.shape[0])]
        pieces.append(chunk[inside - start])
        start += chunk.shape[0]
    return torch.cat(pieces)


def shared_input_scales(weights: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor],
                        groups: list[tuple[str, ...]], scheme: WeightOnlyScheme) -> dict[str, torch.Tensor]:
    """AWQ's ``1 / s`` for every linear with recorded ``inputs`` (name -> ``[N, K]`` weight in
    ``weights``): one per group of linears reading one tensor (q/k/v, gate/up), searched against the
    group's joint output error as the AWQ paper does, so the group can still run as one kernel call."""
    whole = [names for names in groups if all(name in inputs for name in names)]
    grouped = {name for names in whole for name in names}
    scales: dict[str, torch.Tensor] = {}
    for names in whole + [(name,) for name in inputs if name not in grouped]:
        scale = awq_input_scale([weights[name] for name in names], inputs[names[0]], scheme)
        scales.update(dict.fromkeys(names, scale))
    return scales


def awq_input_scale(weights: list[torch.Tensor], x: torch.Tensor, scheme: WeightOnlyScheme,
                    search_rows: int | None = SEARCH_ROWS) -> torch.Tensor:
    """``1 / s`` in the weights' dtype for linears ``[N_i, K]`` all reading inputs like ``x`` ``[T, K]``:
    the strength whose rounding gives the lowest sum of their relative output errors (q, k and v
    count alike, whatever their output scale), each measured on ``search_rows`` evenly spaced output
    rows (``None``: all)."""
    ws = [_evenly_spaced([weight.detach().float()], search_rows or weight.shape[0]) for weight in weights]
    energies = [float((x @ w.T).square().mean().clamp_min(1e-30)) for w in ws]
    activation = x.abs().mean(0).clamp(min=1e-8)
    best_error, s = float("inf"), torch.ones_like(activation)
    for alpha in ALPHAS:
        candidate = activation.pow(alpha)
        candidate = candidate / (candidate.max() * candidate.min()).sqrt()
        error = 0.0
        for w, energy in zip(ws, energies, strict=True):
            delta = quantize(w * candidate, scheme).dequantize() / candidate - w
            error += float((x @ delta.T).square().mean()) / energy
        if error < best_error:
            best_error, s = error, candidate
    # in the model's dtype (a float32 scale would turn a bf16/fp16 model's activations float32)
    return (1 / s).to(weights[0].dtype).contiguous()


def awq_quantize(weight: torch.Tensor, x: torch.Tensor, scheme: WeightOnlyScheme,
                 input_scale: torch.Tensor) -> QuantizedWeight:
    """Quantize ``weight`` ``[N, K]`` for inputs like ``x`` ``[T, K]`` divided by ``s`` (``input_scale``
    is ``1 / s``): the weight scaled by exactly what the activation is divided by, each group clipped."""
    w = weight.detach().float()
    s = 1 / input_scale.float()
    clip = _search_clip(w * s, x[: CLIP_ROWS] / s, scheme)
    return quantize(w * s, scheme, clip)


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
