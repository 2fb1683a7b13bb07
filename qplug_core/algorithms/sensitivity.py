"""Per-layer sensitivity: how much output error each weighted layer causes when int8.

Two figures per layer (or per group of layers), scored on the model's output against float:

* **alone int8**: only this layer int8 (weights, input and output on their grids; every other
  op float) -- the error the layer *causes*;
* **alone float**: every other op int8, this layer's weights float (and its input and output
  where no int8 neighbour needs them rounded) -- what keeping it float *buys*.

Both come from ONE calibration: the model is quantized once (its all-int8 score is the backend's
own converted model), and its reference form's layers become switches (:mod:`.layer_switches`),
so each figure is one forward pass over the evaluation data, not a quantization (two per layer
took 671 s on a small diffusion UNet). ``exact=True`` measures as before: a full quantization
with the backend's flow and kernels for every figure. It differs where leaving neighbours float
changes a value's grid (fbgemm's 7-bit depthwise inputs) and in alone int8, where it keeps every op without
weights (add, matmul) int8 too.

Layers are named as in the fused float model (``qp.fuse_fx``); ``group="role"`` ties the layers
that play the same part in repeated blocks (``encoder.layer.*.output.dense``) so a 6-block
transformer costs 6 measurements per kind instead of 36.
"""

from __future__ import annotations

import copy
import inspect
import math
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import fx, nn

from qplug_core.algorithms._layers import layer_of
from qplug_core.analysis.plain_text import plain_text
from qplug_core.config import QConfigMapping
from qplug_core.errors import ConfigValidationError
from qplug_core.flows.float_reference import float_like_int8
from qplug_core.flows.regions import CallCounter, resolve_qconfig
from qplug_core.flows.tags import CALLED_AS, WEIGHT_BITS_DECIDED, WEIGHT_BITS_REUSE
from qplug_core.observers.tokens import token_mask

__all__ = ["LayerSensitivity", "OutputScore", "SensitivityReport", "sensitivity"]

GROUPS = ("layer", "role")
FALLBACKS = ("float", "dynamic")
#: how a user metric is called (:func:`score`)
METRIC_SIGNATURE = ("metric(reference_outputs, quantized_outputs) -> float, each a list with one tensor per "
                    "evaluation batch: the first tensor output of the float and of the quantized model")


def check_metric(metric: Any, where: str) -> None:
    """``metric`` can be called as :data:`METRIC_SIGNATURE` says (one taking the outputs alone
    raised a bare ``TypeError`` from the first score, deep in a search); a callable without a
    signature (a builtin) is taken as it is."""
    if not callable(metric):
        raise ConfigValidationError(f"{where} must be a function {METRIC_SIGNATURE}", field="metric",
                                    value=repr(metric))
    try:
        signature = inspect.signature(metric)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(None, None)
    except TypeError:
        name = getattr(metric, "__name__", type(metric).__name__)
        raise ConfigValidationError(f"{where}: {name}{signature} cannot take two positional arguments; "
                                    f"it is called as {METRIC_SIGNATURE}", field="metric",
                                    value=f"{name}{signature}") from None


@dataclass(frozen=True)
class OutputScore:
    """Output agreement of a quantized model with float over the evaluation batches."""

    sqnr_db: float
    #: per sample (first output dimension, or its pooled embedding), averaged; outputs of one value a
    #: sample: the one cosine of all samples' values (:func:`sample_cosines`)
    cosine_mean: float
    cosine_min: float
    metric: float | None = None
    #: embedding scores: fraction of samples whose nearest other sample is unchanged
    neighbours_kept: float | None = None
    #: the worst output channel's cosine over all samples (and tokens): a channel rounded away
    #: beside a 1000x larger one leaves every row's cosine at ~1.0 but this at 0
    channel_cosine_min: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: (v if v is None or math.isfinite(v) else str(v)) for k, v in asdict(self).items()}


def first_tensor(output: Any) -> torch.Tensor:
    from qplug_core.analysis.layers import first_tensor as first
    found = first(output)
    if found is None:
        raise ConfigValidationError("the model returned no tensor; scoring needs tensor outputs",
                                    field="model")
    return found


@torch.no_grad()
def float_output(gm: nn.Module, batch: tuple) -> torch.Tensor:
    """The first tensor ``gm`` returns for ``batch``, as float32 (what scores compare), computed as
    the int8 model computes it (:mod:`qplug_core.flows.float_reference`)."""
    with float_like_int8(gm):
        return first_tensor(gm(*batch)).detach().float()


def float_outputs(gm: nn.Module, batches: list[tuple]) -> list[torch.Tensor]:
    return [float_output(gm, batch) for batch in batches]


def padding_masks(gm: fx.GraphModule, batches: list[tuple]) -> list[torch.Tensor | None]:
    """Per batch, the model's ``attention_mask`` input (1 = real token), or None without one.

    A padded token's hidden state means nothing (nothing reads it after pooling) and drifts the
    most under int8, so scoring it would keep layers float for no user-visible gain."""
    return [token_mask(gm, batch) for batch in batches]


def _without_padding(output: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``output`` with padded tokens zeroed (they then add nothing to a cosine or an SQNR)."""
    if mask is None or output.dim() < 2 or tuple(output.shape[:2]) != tuple(mask.shape):
        return output
    return output * (mask != 0).reshape(*mask.shape, *([1] * (output.dim() - 2))).to(output.dtype)


def is_embedding_output(reference: list[torch.Tensor], masks: list[torch.Tensor | None]) -> bool:
    """Token states ``[batch, tokens, hidden]`` beside an attention mask: a sentence encoder,
    whose users compare the mean-pooled, L2-normalised embedding (sentence-transformers)."""
    return bool(reference) and all(
        mask is not None and out.dim() == 3 and tuple(out.shape[:2]) == tuple(mask.shape)
        for out, mask in zip(reference, masks))


def pooled_embedding(output: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[batch, hidden]``: the mean over the real tokens, L2-normalised."""
    weights = (mask != 0).unsqueeze(-1).to(torch.float64)
    pooled = (output.double() * weights).sum(1) / weights.sum(1).clamp_min(1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1)


#: cosine by which float's nearest neighbour must beat another row for picking that row to count as
#: losing the neighbour: closer rows are ties, which int8 rounding (cosine ~0.999) cannot be asked to keep
NEAR_TIE = 1e-3


def _similarities(embeddings: torch.Tensor) -> torch.Tensor:
    sims = embeddings @ embeddings.T
    sims.fill_diagonal_(-2.0)
    return sims


def neighbours_kept(want: torch.Tensor, got: torch.Tensor) -> float | None:
    """Fraction of rows of ``got`` whose nearest other row (cosine) is, in ``want``, as near as
    ``want``'s nearest within :data:`NEAR_TIE` (the same row, or one float ties with it)."""
    if want.shape[0] < 3:
        return None
    float_sims = _similarities(want)
    picked = float_sims.gather(1, _similarities(got).argmax(1, keepdim=True)).squeeze(1)
    return float((picked >= float_sims.amax(1) - NEAR_TIE).double().mean())


def _channels(t: torch.Tensor) -> torch.Tensor:
    """``[rows, channels]``: the channel axis last (axis 1 of an image-like ``[N, C, H, W...]``
    output, else the last axis), every other axis flattened into rows."""
    if t.dim() >= 4:
        t = t.movedim(1, -1)
    return t.reshape(-1, t.shape[-1]) if t.dim() > 1 else t.reshape(-1, 1)


@dataclass
class _ChannelCosines:
    """Per output channel: sums of want x got, want^2 and got^2 over every batch."""

    sums: torch.Tensor | None = None

    def add(self, want: torch.Tensor, got: torch.Tensor) -> None:
        w, g = _channels(want).double(), _channels(got).double()
        sums = torch.stack([(w * g).sum(0), w.square().sum(0), g.square().sum(0)])
        self.sums = sums if self.sums is None or self.sums.shape != sums.shape else self.sums + sums

    def worst(self) -> float | None:
        """The lowest cosine of a channel that float ever makes non-zero (None without one)."""
        if self.sums is None:
            return None
        dot, want, got = self.sums
        live = want > 0
        if not bool(live.any()):
            return None
        cosines = dot[live] / (want[live].sqrt() * got[live].sqrt()).clamp_min(1e-300)
        return float(cosines.min())


@torch.no_grad()
def score(qmodel: nn.Module, batches: list[tuple], reference: list[torch.Tensor],
          metric: Any = None, masks: list[torch.Tensor | None] | None = None, *,
          embedding: bool = False) -> OutputScore:
    """SQNR, per-sample cosine (mean, min) and the user metric of ``qmodel`` against ``reference``.

    ``masks`` (from :func:`padding_masks`) leave padded tokens out of the SQNR and the cosine;
    with ``embedding=True`` (see :func:`is_embedding_output`) the cosines and the neighbour
    agreement are those of the pooled embeddings. The metric gets the outputs as the model
    returns them."""
    from qplug_core.analysis.layers import ErrorStats

    masks = masks or [None] * len(batches)
    stats, rows, outputs, pooled, channels = ErrorStats(), ([], []), [], ([], []), _ChannelCosines()
    for batch, want, mask in zip(batches, reference, masks):
        got = first_tensor(qmodel(*batch)).detach().float()
        outputs.append(got)
        want_real, got_real = _without_padding(want, mask), _without_padding(got, mask)
        stats.update(want_real, got_real)
        if embedding:
            rows_w, rows_g = pooled_embedding(want, mask), pooled_embedding(got, mask)
            pooled[0].append(rows_w)
            pooled[1].append(rows_g)
        else:
            rows_w, rows_g = want_real.reshape(want.shape[0], -1), got_real.reshape(got.shape[0], -1)
        rows[0].append(rows_w)
        rows[1].append(rows_g)
        if embedding:
            channels.add(rows_w, rows_g)
        else:
            channels.add(want_real, got_real)
    cos = sample_cosines(*rows)
    value = float(metric(reference, outputs)) if metric is not None else None
    kept = neighbours_kept(torch.cat(pooled[0]), torch.cat(pooled[1])) if embedding else None
    return OutputScore(stats.sqnr_db, float(cos.mean()), float(cos.min()), value, kept, channels.worst())


def sample_cosines(want: list[torch.Tensor], got: list[torch.Tensor]) -> torch.Tensor:
    """Each sample's cosine (rows ``[samples, values]`` per batch). A sample of one value (a logit,
    a regression output) has a cosine of only +1, -1 or 0, and a logit near 0 changing sign failed
    every ``min_cosine``: such outputs are compared as one vector of all samples' values, centred
    on the reference's mean (:func:`_centred`), a single cosine that measures the error relative
    to the outputs' spread."""
    if all(w.shape[1] == 1 for w in want):
        want, got = _centred(torch.cat(want).reshape(1, -1).double(), torch.cat(got).reshape(1, -1).double())
        want, got = [want], [got]
    return torch.cat([torch.nn.functional.cosine_similarity(w.double(), g.double(), dim=1)
                      for w, g in zip(want, got)])


def _layer_qconfigs(gm: fx.GraphModule, mapping: QConfigMapping) -> dict[str, Any]:
    """Each weighted layer's qconfig under ``mapping``, by its name in ``gm``, in graph order."""
    modules = dict(gm.named_modules(remove_duplicate=False))
    counter, qconfigs = CallCounter(), {}
    for node in gm.graph.nodes:
        if layer_of(gm, node) is not None and node.target not in qconfigs:
            qconfigs[node.target] = resolve_qconfig(mapping, node, modules, counter)
    return qconfigs


def _centred(want: torch.Tensor, got: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both less the mean of ``want``: the cosine of a regressor's outputs near a constant (FT-
    Transformer, mean 0.61, std 0.37) is dominated by that constant, so 0.998 let through 4e-3 of
    the outputs' variance (0.9994 uncentred, 0.998 centred), and a model answering the mean
    alone scored ~1. Left uncentred where the reference has no spread (one sample)."""
    centred = want - want.mean()
    if float(centred.norm()) <= 1e-9 * float(want.norm()):
        return want, got
    return centred, got - want.mean()


def quantized_layers(gm: fx.GraphModule, mapping: QConfigMapping) -> list[str]:
    """Names of the weighted layers ``mapping`` quantizes statically, in graph order."""
    return [name for name, qconfig in _layer_qconfigs(gm, mapping).items()
            if qconfig is not None and qconfig.weight is not None
            and not getattr(qconfig.activation(), "is_dynamic", False)]


def calls_apart(mapping: QConfigMapping, gm: fx.GraphModule) -> QConfigMapping:
    """A copy of ``mapping`` naming each later call of a shared layer (its copy in ``gm``,
    ``mid_call1``) with the qconfig it has: a rule then set for the module's name (``mid``) changes
    its first call only, as a rule for the copy changes only that call."""
    result, qconfigs = copy.deepcopy(mapping), _layer_qconfigs(gm, mapping)
    for node in gm.graph.nodes:
        if CALLED_AS in node.meta and node.target in qconfigs:
            result.set_module_name(node.target, qconfigs[node.target])
    return result


def call_names(gm: fx.GraphModule) -> dict[str, str]:
    """Each weighted layer's name in a report, by its name in ``gm``: the module's path, and for a
    module called more than once in ``forward`` (each call quantized on its own) the call's number,
    ``mid (call 2)`` (:data:`CALLS_NOTE`)."""
    paths = {node.target: node.meta.get(CALLED_AS, node.target)
             for node in gm.graph.nodes if layer_of(gm, node) is not None}
    calls: dict[str, int] = {}
    named = {}
    for target, path in paths.items():
        calls[path] = calls.get(path, 0) + 1
        named[target] = (path, calls[path])
    return {target: path if calls[path] == 1 else f"{path} (call {index})"
            for target, (path, index) in named.items()}


#: what a report says of a layer named ``mid (call 2)``
CALLS_NOTE = ("'name (call k)': the k-th call of a module forward calls more than once; each call is "
              "quantized, and measured, on its own")


def group_layers(names: list[str], group: str) -> list[list[str]]:
    """Layer names grouped one by one, or by role (numeric path parts replaced by ``*``)."""
    if group not in GROUPS:
        raise ConfigValidationError(f"group must be one of {GROUPS}, got {group!r}", field="group",
                                    value=group)
    if group == "layer":
        return [[n] for n in names]
    roles: dict[str, list[str]] = {}
    for name in names:
        roles.setdefault(re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", name), []).append(name)
    return list(roles.values())


def role_name(layers: list[str]) -> str:
    return layers[0] if len(layers) == 1 else re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", layers[0])


def with_fallback(mapping: QConfigMapping, layers: list[str], fallback: str, backend: Any,
                  gm: fx.GraphModule) -> QConfigMapping:
    """A copy of ``mapping`` with ``layers`` left float, or dynamic int8 where they are Linear."""
    if fallback not in FALLBACKS:
        raise ConfigValidationError(f"fallback must be one of {FALLBACKS}, got {fallback!r}",
                                    field="fallback", value=fallback)
    result = calls_apart(mapping, gm)
    dynamic = None
    if fallback == "dynamic" and layers:  # asked only when used: a backend may have no dynamic defaults
        dynamic = backend.default_qconfig_mapping("dynamic").qconfig_for_module("", nn.Linear)
    for name in layers:
        is_linear = isinstance(layer_of(gm, _node_named(gm, name)), nn.Linear)
        result.set_module_name(name, dynamic if is_linear else None)
    return result


def _node_named(gm: fx.GraphModule, target: str) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == target)


@dataclass(frozen=True)
class LayerSensitivity:
    """One layer (or role group) and the output scores with it alone int8 and alone float."""

    name: str
    layers: tuple[str, ...]
    alone_int8: OutputScore
    alone_float: OutputScore


@dataclass
class SensitivityReport:
    """Layers ranked by what keeping them float buys (highest alone-float SQNR first)."""

    all_int8: OutputScore
    layers: list[LayerSensitivity] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": 1, "all_int8": self.all_int8.to_dict(),
                "layers": [{"name": s.name, "layers": list(s.layers),
                            "alone_int8": s.alone_int8.to_dict(),
                            "alone_float": s.alone_float.to_dict()} for s in self.layers]}

    def __rich__(self) -> Table:
        with_metric = self.all_int8.metric is not None  # the user's own score, beside ours
        metric = f", metric {self.all_int8.metric:.4g}" if with_metric else ""
        table = Table(title=f"per-layer sensitivity (all int8: SQNR {self.all_int8.sqnr_db:.1f} dB, "
                            f"cosine {self.all_int8.cosine_mean:.4f}{metric})", title_justify="left",
                      caption=CALLS_NOTE if any(" (call " in s.name for s in self.layers) else None,
                      caption_justify="left")
        table.add_column("layer", overflow="fold")
        for side in ("int8", "float"):
            for column in ("SQNR", "cos", *(("metric",) if with_metric else ())):
                table.add_column(f"alone {side} {column}", justify="right")
        for s in self.layers:
            table.add_row(s.name, *_cells(s.alone_int8, with_metric), *_cells(s.alone_float, with_metric))
        return table

    def print(self, console: Console | None = None) -> None:
        (console or Console()).print(self)

    def __str__(self) -> str:
        """The table as ``print(report)`` shows it (80 columns), not the dataclass fields."""
        return plain_text(self)


def _cells(score: OutputScore, with_metric: bool) -> list[str]:
    cells = [f"{score.sqnr_db:.1f}", f"{score.cosine_mean:.4f}"]
    if with_metric:
        cells.append("-" if score.metric is None else f"{score.metric:.4g}")
    return cells


def sensitivity(model: nn.Module, example_inputs: Any, calibration_data: Any, *,
                backend: Any = None, qconfig_mapping: QConfigMapping | None = None,
                data: Any = None, recipe: Any = "none", group: str = "layer",
                metric: Any = None, exact: bool = False) -> SensitivityReport:
    """Rank ``model``'s weighted layers by the output error each causes when int8.

    ``data`` are the evaluation batches (default: the calibration data); ``recipe`` runs first as
    in :func:`qp.quantize`; ``metric`` adds a user score (:data:`METRIC_SIGNATURE`). Costs one
    quantization and two forward passes over ``data`` per layer (or role group), the layers
    switched in the reference form (:mod:`.layer_switches`); ``exact=True`` quantizes twice per
    layer with the backend's own flow and kernels instead (the old measurement: slow).
    """
    from qplug_core.algorithms.pipeline import prepare_algorithms
    from qplug_core.flows.steps import resolve_backend

    if metric is not None:
        check_metric(metric, "qp.sensitivity(metric=...)")
    chosen = resolve_backend(backend).require_available()
    gm, inputs, batches, mapping, _ = prepare_algorithms(model, example_inputs, calibration_data,
                                                         chosen, qconfig_mapping, recipe, {})
    evaluation = batches if data is None else [tuple(b) if isinstance(b, (tuple, list)) else (b,)
                                               for b in data]
    reference, masks = float_outputs(gm, evaluation), padding_masks(gm, evaluation)

    def scored(qmodel: nn.Module) -> OutputScore:
        return score(qmodel, evaluation, reference, metric, masks)

    names = quantized_layers(gm, mapping)
    shown = call_names(gm)
    target_of = {shown[name]: name for name in names}
    groups = [[target_of[n] for n in g] for g in group_layers([shown[name] for name in names], group)]
    measure = _quantized_per_layer if exact else _switched_per_layer
    report = measure(gm, inputs, batches, chosen, mapping, names, groups, scored)
    report.layers = sorted((replace(s, name=role_name([shown[n] for n in s.layers]),
                                    layers=tuple(shown[n] for n in s.layers)) for s in report.layers),
                           key=lambda s: -s.alone_float.sqnr_db)
    return report


def _switched_per_layer(gm: fx.GraphModule, inputs: tuple, batches: list[tuple], backend: Any,
                        mapping: QConfigMapping, names: list[str], groups: list[list[str]],
                        scored: Any) -> SensitivityReport:
    """One calibration: all int8 on the backend's kernels, then each group switched alone int8 in
    the float graph and alone float in the reference form of the same calibrated observers."""
    from qplug_core.algorithms.layer_switches import flipped, with_switches
    from qplug_core.algorithms.pipeline import prepare_sharing_weights
    from qplug_core.flows.steps import calibrate, convert_fx, convert_to_reference_fx

    calibrated = prepare_sharing_weights(gm, mapping, inputs, backend)
    calibrate(calibrated, batches, progress=False)
    all_int8 = convert_fx(calibrated, backend=backend)
    report = SensitivityReport(scored(all_int8))
    if WEIGHT_BITS_DECIDED in all_int8.meta:  # the reference weights on the backend's weight bits
        calibrated.meta[WEIGHT_BITS_REUSE] = all_int8.meta[WEIGHT_BITS_DECIDED]
    del all_int8
    int8_form = convert_to_reference_fx(calibrated, inplace=True)
    alone = alone_int8_scores(gm, int8_form, names, groups, scored)
    int8_side, to_float = with_switches(int8_form, int8_form, gm, names, int8=True)
    for layers, alone_int8 in zip(groups, alone):
        with flipped([s for name in layers for s in to_float.get(name, [])]):
            alone_float = scored(int8_side)
        report.layers.append(LayerSensitivity(role_name(layers), tuple(layers), alone_int8, alone_float))
    return report


def alone_int8_scores(gm: fx.GraphModule, int8_form: fx.GraphModule, names: list[str],
                      groups: list[list[str]], scored: Any) -> list[OutputScore]:
    """The score of the fused float graph ``gm`` with each group alone int8 (its grids and rounded
    weights from ``int8_form``, the reference form of the calibrated model): one pass over the
    data per group, which sees what a local error cannot, how much later layers amplify it."""
    from qplug_core.algorithms.layer_switches import flipped, with_switches

    float_side, to_int8 = with_switches(gm, int8_form, gm, names, int8=False)
    scores = []
    for layers in groups:
        with flipped([s for name in layers for s in to_int8.get(name, [])]):
            scores.append(scored(float_side))
    return scores


def _quantized_per_layer(gm: fx.GraphModule, inputs: tuple, batches: list[tuple], backend: Any,
                         mapping: QConfigMapping, names: list[str], groups: list[list[str]],
                         scored: Any) -> SensitivityReport:
    """Two full quantizations per group with the backend's flow and kernels (``exact=True``)."""
    from qplug_core.algorithms.pipeline import quantize_fused

    def run(m: QConfigMapping) -> OutputScore:
        return scored(quantize_fused(gm, inputs, batches, backend, m, progress=False))

    report = SensitivityReport(run(mapping))
    for layers in groups:
        alone_int8 = calls_apart(mapping, gm)
        for name in names:
            if name not in layers:
                alone_int8.set_module_name(name, None)
        report.layers.append(LayerSensitivity(
            role_name(layers), tuple(layers), run(alone_int8),
            run(with_fallback(mapping, layers, "float", backend, gm))))
    return report
