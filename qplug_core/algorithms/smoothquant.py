"""SmoothQuant (Xiao et al., ICML 2023): move activation outliers of linear inputs into the weights.

Trained transformers carry a few input channels whose activations are 10-100x the rest; one
per-tensor int8 scale for such an input leaves the ordinary channels a handful of levels. For a
linear ``y = x W^T``, dividing input channel ``j`` by ``s_j`` and multiplying weight column ``j``
by it changes nothing in float, and with ``s_j = max|x_j|^a / max|W_:,j|^(1-a)`` it evens the
activation channels at the cost of slightly uneven weight columns (which per-channel weights
absorb well).

Here ``a`` is searched per input (linears reading the same tensor, such as attention's query,
key and value, share one scale): for each candidate the layers' int8 output error on recorded
calibration rows, with the qconfig's own activation and weight observers, is measured and the
best kept, including "no smoothing". The division is a :class:`ChannelScale` node in front of
the layers, so any producer works (a LayerNorm that also feeds a residual, a GELU, a reshape).

Each candidate is scored on rows its scale and activation range never saw: the first half of the
recorded calibration rows fits them and the second half is scored, then the other way round.
Scored on the rows that fitted them, a strong smoothing always looks best, as no row exceeds the
range; but it evens the channels' maxima, so a channel quiet in calibration that spikes on new
data (a new topic's words) is multiplied up and clipped: all-MiniLM-L6-v2 took 0.8 almost
everywhere and fell to a cosine of 0.979 on a held-out sentence whose FFN input exceeded a
channel's calibrated maximum 21x (6x the smoothed tensor's range), worse than no smoothing (0.991).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from qplug_core import qparams as Q
from qplug_core.algorithms._calibration import run_hooked
from qplug_core.algorithms._layers import layer_of
from qplug_core.config import QConfigMapping
from qplug_core.errors import ConfigValidationError
from qplug_core.flows.regions import CallCounter, resolve_qconfig
from qplug_core.kernels.reference import observed_weight_qparams
from qplug_core.kernels.smoothquant_scale import ALPHAS, held_out_halves, smoothquant_scale
from qplug_core.nn.channel_scale import ChannelScale
from qplug_core.observers.tokens import real_tokens

__all__ = ["ALPHAS", "SmoothedInput", "smooth_quant"]

_SAMPLE_ROWS = 2048
#: the strength search scores every 8th recorded row: each candidate runs the activation observer
#: (a histogram by default) over them, and 256 rows spread over the first batches rank the
#: strengths at an eighth of the cost (with all 2,048 rows the search took half of qp.quantize's
#: time on all-MiniLM-L6-v2; its held-out embedding figures stay within 0.0002)
_SEARCH_STRIDE = 8


@dataclass
class SmoothedInput:
    """One smoothed input: the layers reading it, the strength chosen and the errors measured
    without smoothing and with it (on rows the scale and range were not fitted on)."""

    layers: list[str]
    alpha: float | None
    error_before: float
    error_after: float


class _InputRecorder:
    """Pre-hook keeping per-channel max |x| and up to ``_SAMPLE_ROWS`` rows of a layer's input."""

    def __init__(self) -> None:
        self.absmax: torch.Tensor | None = None
        self.rows: list[torch.Tensor] = []
        self.kept = 0

    def __call__(self, module: nn.Module, args: tuple) -> None:
        x = real_tokens(args[0].detach().float())  # padded tokens: their maxima and rows do not count
        rows = x.reshape(-1, x.shape[-1])
        found = rows.abs().amax(0)
        self.absmax = found if self.absmax is None else torch.maximum(self.absmax, found)
        if self.kept < _SAMPLE_ROWS:
            take = rows[: _SAMPLE_ROWS - self.kept].clone()
            self.rows.append(take)
            self.kept += take.shape[0]

    def folds(self) -> list[tuple[_Rows, _Rows]]:
        """(fitting, scored) pairs: the first half of the recorded rows (in calibration order)
        against the second and the other way round; a single row is scored on itself."""
        halves = held_out_halves(torch.cat(self.rows))
        return [(_Rows.of(fitting), _Rows.of(scored)) for fitting, scored in halves]


@dataclass
class _Rows:
    """Every ``_SEARCH_STRIDE``-th of some recorded rows, and the per-channel max |x| of all of them."""

    absmax: torch.Tensor
    rows: torch.Tensor

    @classmethod
    def of(cls, rows: torch.Tensor) -> _Rows:
        return cls(rows.abs().amax(0), rows[::_SEARCH_STRIDE])


#: producers whose output is int8 between int8 regions: a ChannelScale after them would force it
#: back to float (breaking the int8 chain) for a small gain, so their consumers are not smoothed
_INT8_PRODUCERS = (operator.add, torch.add, operator.mul, torch.mul, torch.cat, "add", "mul")


def _feeds_int8_chain(gm: fx.GraphModule, value: fx.Node) -> bool:
    return value.target in _INT8_PRODUCERS or layer_of(gm, value) is not None


def _groups(gm: fx.GraphModule, mapping: QConfigMapping) -> dict[fx.Node, list[tuple[fx.Node, Any]]]:
    """input value -> [(linear node, qconfig)] for every linear the mapping quantizes whose input
    comes from a float-producing op (LayerNorm, GELU, reshapes...)."""
    modules = dict(gm.named_modules(remove_duplicate=False))
    counter, groups = CallCounter(), {}
    for node in gm.graph.nodes:
        layer = layer_of(gm, node)
        if not isinstance(layer, nn.Linear) or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        if _feeds_int8_chain(gm, node.args[0]):
            continue
        qconfig = resolve_qconfig(mapping, node, modules, counter)
        if qconfig is None or qconfig.weight is None or getattr(qconfig.activation(), "is_dynamic", False):
            continue  # float or dynamic: no calibrated input scale to protect
        groups.setdefault(node.args[0], []).append((node, qconfig))
    return groups


def _quantized(x: torch.Tensor, fitting: torch.Tensor, observer_factory: Any) -> torch.Tensor:
    """``x`` on the grid the activation observer sets from ``fitting`` (values beyond it clip)."""
    observer = observer_factory()
    observer(fitting)
    qparams = observer.qparams()
    return Q.fake_quantize(x, qparams) if qparams.dtype in Q.STORAGE_DTYPE else x


def _error(folds: list[tuple[_Rows, _Rows]], layers: list[tuple[nn.Module, Any]], weights: torch.Tensor,
           alpha: float | None) -> float:
    """Relative int8 output error of the layers with strength ``alpha`` on each fold's scored rows,
    the smoothing scale and the activation range fitted on its other rows."""
    num = den = 0.0
    for fitting, scored in folds:
        scale = None if alpha is None else smoothquant_scale(fitting.absmax, [weights], alpha)
        x, fit = (scored.rows, fitting.rows) if scale is None else (scored.rows / scale, fitting.rows / scale)
        xq = _quantized(x, fit, layers[0][1].activation)
        for layer, qconfig in layers:
            weight = layer.weight.detach() if scale is None else layer.weight.detach() * scale
            wq = Q.fake_quantize(weight, observed_weight_qparams(qconfig, weight))
            want = scored.rows @ layer.weight.detach().T
            num += float((xq @ wq.T - want).square().sum())
            den += float(want.square().sum())
    return num / max(den, 1e-30)


def smooth_quant(gm: fx.GraphModule, calibration_data: Any, *, qconfig_mapping: QConfigMapping,
                 backend: Any = None, alphas: tuple[float | None, ...] = ALPHAS) -> list[SmoothedInput]:
    """Smooth every quantized linear's input of a fused float graph in place (float function kept).

    ``calibration_data`` is the data calibration will use; ``qconfig_mapping`` the mapping
    quantization will use (its observers score the candidates). Returns one entry per input.
    """
    if not isinstance(qconfig_mapping, QConfigMapping):
        raise ConfigValidationError("smooth_quant needs the QConfigMapping quantization will use",
                                    field="qconfig_mapping")
    groups = _groups(gm, qconfig_mapping)
    recorders = {value: _InputRecorder() for value in groups}
    handles = [gm.get_submodule(members[0][0].target).register_forward_pre_hook(recorders[value])
               for value, members in groups.items()]
    run_hooked(gm, calibration_data, handles, "smooth_quant")
    results = []
    with torch.no_grad():
        for count, (value, members) in enumerate(groups.items()):
            recorder = recorders[value]
            if recorder.absmax is None:
                continue
            layers = [(layer_of(gm, node), qconfig) for node, qconfig in members]
            weights = torch.cat([layer.weight.detach() for layer, _ in layers])
            folds = recorder.folds()
            scored = [(_error(folds, layers, weights, alpha), alpha) for alpha in alphas]
            before = scored[alphas.index(None)][0] if None in alphas else scored[0][0]
            best_error, best_alpha = min(scored, key=lambda item: item[0])
            results.append(SmoothedInput([n.target for n, _ in members], best_alpha, before,
                                         best_error))
            if best_alpha is not None:  # the scale itself from every calibration batch
                _apply(gm, value, members, layers, smoothquant_scale(recorder.absmax, [weights], best_alpha),
                       f"smoothquant_{count}")
    gm.graph.lint()
    gm.recompile()
    return results


def _apply(gm: fx.GraphModule, value: fx.Node, members, layers, scale: torch.Tensor, name: str) -> None:
    for layer, _ in layers:
        layer.weight.mul_(scale)
    gm.add_submodule(name, ChannelScale(1.0 / scale))
    with gm.graph.inserting_after(value):
        node = gm.graph.call_module(name, args=(value,))
    node.meta.update({k: v for k, v in value.meta.items() if k == "nn_module_stack"})
    for linear, _ in members:
        linear.replace_input_with(value, node)
