"""Accuracy targets: ``qp.quantize(..., target=qp.Target(cosine=0.99))``.

The cost is a small multiple of one plain quantization. The fused graph is prepared and calibrated
ONCE; the all-int8 model is converted and scored. If it misses the target, one pass of the float
model over the evaluation data measures every weighted layer's local error under static int8 and
under each fallback (:mod:`.layer_errors`, using the calibrated observers), layers (or role groups,
see :mod:`.sensitivity`) are ranked by that error, and the worst 1, 2, 4, ... groups are taken out
until the converted model meets the target. Each try reuses the calibrated observers
(:mod:`.reuse`): prepare and convert, no calibration. For a cosine target, a search that ends
with every layer out (or missing) runs again ranked by the output's cosine with each layer alone
static int8 (:mod:`.layer_switches`, one pass per layer), which sees what later layers amplify.

"Taken out" means the first rung of this CPU's fallback ladder (:mod:`.fallbacks`: per-token
dynamic where its int8 GEMM is fast, per-tensor dynamic, float) whose local error is as small as a
typical (median) static int8 layer's, chosen layer by layer within a group; ``fallback="float"``,
``"dynamic"`` or ``"per_token"`` forces one. For a sentence encoder (token states beside an ``attention_mask``) the cosines are
those of the embedding its users compare (mean-pooled over the mask, L2-normalised) and the
result reports nearest-neighbour agreement, which ``Target(neighbours=...)`` (and the
transformer default) also requires. The decisions are in ``qmodel.meta["qplug_target"]``.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from qplug_core.algorithms.fallbacks import fallback_ladder, name_fallbacks, per_token_qmax, run_per_token
from qplug_core.algorithms.layer_errors import LayerError, layer_errors
from qplug_core.algorithms.sensitivity import (
    GROUPS,
    OutputScore,
    alone_int8_scores,
    check_metric,
    group_layers,
    is_embedding_output,
    padding_masks,
    pooled_embedding,
    quantized_layers,
    role_name,
    score,
    with_fallback,
)
from qplug_core.config import QConfigMapping
from qplug_core.errors import ConfigValidationError, warn_user
from qplug_core.flows.regions import CallCounter, resolve_qconfig
from qplug_core.flows.snapshot import snapshot_of
from qplug_core.flows.tags import TARGET, WEIGHT_BITS_DECIDED, WEIGHT_BITS_REUSE
from qplug_core.flows.weight_bits import converted_weight_ranges
from qplug_core.observers.tokens import token_mask

__all__ = ["TARGET", "TARGET_MISSED", "TRANSFORMER_TARGET", "Target", "TargetResult", "meet_target", "scored_embedding"]

#: how the warning of a target the search could not meet begins
TARGET_MISSED = "qplug: accuracy target not met"


#: the values of ``Target.fallback``: "auto" climbs this CPU's ladder (:mod:`.fallbacks`)
TARGET_FALLBACKS = ("auto", "per_token", "dynamic", "float")
#: the values of ``Target.score``: "auto" scores a sentence encoder by its pooled embedding
SCORES = ("auto", "embedding", "output")


#: the fields of ``Target`` that hold thresholds: each None or a finite real number
NUMERIC_FIELDS = ("cosine", "min_cosine", "sqnr", "minimum", "channel_cosine", "neighbours")


def _is_finite_real(value: object) -> bool:
    """A real number (a bool is not one here) that is neither NaN nor infinite."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Target:
    """What the quantized model's output must reach against float, on ``data`` (default: the
    calibration data): mean per-sample ``cosine``, worst-sample ``min_cosine`` (an output of one
    value a sample: both the cosine of all samples' values as one vector, less the float
    outputs' mean), output ``sqnr`` in dB,
    and/or ``metric(reference_outputs, quantized_outputs) >= minimum``; for a sentence encoder also
    ``neighbours``, the fraction of samples whose nearest other sample (by embedding cosine) is unchanged (ignored for other outputs, which have no neighbours). When the model
    has an ``attention_mask`` input (Hugging Face's convention), padded tokens are left out of
    the cosine and the SQNR: nothing downstream reads them; with token states as output
    (``score="auto"`` or ``"embedding"``) the cosines are those of the mean-pooled, L2-normalised
    embeddings, as sentence-transformers computes them (``score="output"``: the raw output).
    """

    cosine: float | None = None
    min_cosine: float | None = None
    sqnr: float | None = None
    metric: Callable[[list, list], float] | None = None
    minimum: float | None = None
    data: Any = None
    fallback: str = "auto"
    group: str = "role"
    score: str = "auto"
    #: the worst output channel's cosine over the samples must reach this: 0.5 catches a channel
    #: lost (rounded away beside a much larger one, which every row's cosine hides), not int8's
    #: ordinary noise; None leaves it out
    channel_cosine: float | None = 0.5
    #: embedding scores only: the fraction of samples that must keep their nearest neighbour
    neighbours: float | None = None

    def __post_init__(self) -> None:
        if all(v is None for v in (self.cosine, self.min_cosine, self.sqnr, self.metric)):
            raise ConfigValidationError("Target needs cosine=, min_cosine=, sqnr= or metric=",
                                        field="Target")
        if (self.metric is None) != (self.minimum is None):
            raise ConfigValidationError("Target(metric=...) and minimum= go together: the metric "
                                        "must reach minimum", field="minimum", value=self.minimum)
        if self.metric is not None:
            check_metric(self.metric, "Target.metric")
        for name in NUMERIC_FIELDS:
            value = getattr(self, name)
            if value is not None and not _is_finite_real(value):
                raise ConfigValidationError(f"Target.{name} must be a finite number, got {value!r}",
                                            field=name, value=value)
        for name in ("cosine", "min_cosine", "channel_cosine"):
            value = getattr(self, name)
            if value is not None and not -1.0 <= value <= 1.0:
                raise ConfigValidationError(f"Target.{name} must be in [-1, 1], got {value}",
                                            field=name, value=value)
        if self.neighbours is not None and not 0.0 <= self.neighbours <= 1.0:
            raise ConfigValidationError(f"Target.neighbours is a fraction of samples, in [0, 1]; "
                                        f"got {self.neighbours}", field="neighbours",
                                        value=self.neighbours)
        for name, allowed in (("fallback", TARGET_FALLBACKS), ("group", GROUPS), ("score", SCORES)):
            value = getattr(self, name)
            if value not in allowed:
                raise ConfigValidationError(f"Target.{name} must be one of {allowed}, got {value!r}",
                                            field=name, value=value)

    def misses(self, s: OutputScore) -> list[str]:
        """Which criteria ``s`` fails, as readable text (empty: the target is met)."""
        return [f"{name} {_apart(got, want)}" for name, want, got in self._missed_criteria(s)]

    def shortfall(self, s: OutputScore) -> tuple[int, float]:
        """How far ``s`` is from the target, smaller is closer: the number of criteria missed,
        then the largest miss relative to its wanted value (``(want - got) / |want|``), so that
        tries missing in different units (dB, cosine, a metric) still compare."""
        relative = [(want - got) / (abs(want) or 1.0) if math.isfinite(got) else math.inf
                    for _, want, got in self._missed_criteria(s)]
        return len(relative), max(relative, default=0.0)

    def _missed_criteria(self, s: OutputScore) -> list[tuple[str, float, float]]:
        """(name, wanted, got) of each criterion ``s`` fails."""
        checks = [("cosine", self.cosine, s.cosine_mean), ("min_cosine", self.min_cosine, s.cosine_min),
                  ("sqnr", self.sqnr, s.sqnr_db), ("metric", self.minimum, s.metric),
                  ("neighbours", self.neighbours, s.neighbours_kept),
                  ("channel_cosine", self.channel_cosine, s.channel_cosine_min)]
        return [(name, want, got) for name, want, got in checks
                if want is not None and got is not None and not got >= want]

    def ladder(self, backend: Any = None) -> tuple[str, ...]:
        """The fallbacks a layer out of static int8 may take on ``backend``, best first."""
        if self.fallback == "per_token" and getattr(backend, "delegate", None) is not None:
            raise ConfigValidationError(
                f"Target(fallback='per_token') cannot run on backend {backend.name!r}: it compiles "
                "partitions from the reference form, which has no per-token layer; use "
                "fallback='dynamic' or 'float'", field="fallback", value=self.fallback)
        return fallback_ladder(backend) if self.fallback == "auto" else (self.fallback,)


#: what ``recipe="auto"`` aims for on a transformer when no target is given (on calibration data,
#: scored on the pooled embedding for a sentence encoder): tighter than what users are promised
#: on sentences calibration never saw (0.995 / 0.99, 92% of nearest neighbours). Neighbours too,
#: 3 points above the promise as the cosines are above theirs: the cosines alone let the search
#: stop where MiniLM (AVX2 decisions) kept 94% on calibration but 91% on unseen sentences.
TRANSFORMER_TARGET = Target(cosine=0.998, min_cosine=0.995, neighbours=0.95)


@dataclass
class Decision:
    """Layers taken out of static int8, how, and the local errors that ranked them."""

    name: str
    layers: tuple[str, ...]
    fallback: str
    reason: str


@dataclass
class TargetResult:
    """Whether the target was met, the final score, and the layers taken out of static int8.

    ``quantizations`` counts the converted models (calibration ran once); ``errors`` are the
    local errors measured for every layer (empty when the all-int8 model met the target)."""

    target: Target
    met: bool
    all_int8: OutputScore
    final: OutputScore
    decisions: list[Decision] = field(default_factory=list)
    quantizations: int = 0
    errors: list[LayerError] = field(default_factory=list)

    @property
    def float_layers(self) -> list[str]:
        return [name for d in self.decisions for name in d.layers]


def scored_embedding(qmodel: nn.Module) -> tuple[str, Callable[[torch.Tensor, tuple], torch.Tensor | None]] | None:
    """What the accuracy target of ``qmodel`` scored in place of its first output, for the final
    check to report too: the mean-pooled, L2-normalised embedding of a sentence encoder (with
    the function computing it from the output and its batch); None where the target scored the
    output itself, or there was no target."""
    result = getattr(qmodel, "meta", {}).get(TARGET)
    if result is None or result.target.score == "output":
        return None

    def pooled(output: torch.Tensor, batch: tuple) -> torch.Tensor | None:
        mask = token_mask(qmodel, batch)
        return pooled_embedding(output, mask) if is_embedding_output([output], [mask]) else None

    return "pooled embedding", pooled


def _parse(data: Any) -> list[tuple] | None:
    if data is None:
        return None
    from qplug_core.flows.steps import iter_batches
    return list(iter_batches(data))


def _scored_ancestors(gm: fx.GraphModule) -> set[str]:
    """Names of the nodes the scored output (the first tensor returned) depends on."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    leaves: list[fx.Node] = []
    fx.node.map_arg(output.args, leaves.append)
    seen: set[str] = set()
    stack = leaves[:1]
    while stack:
        node = stack.pop()
        if node.name not in seen:
            seen.add(node.name)
            stack.extend(node.all_input_nodes)
    return seen


def _rung(errors: list[LayerError], ladder: tuple[str, ...], threshold: float) -> str:
    """The first fallback whose local error on every layer of a group is at most ``threshold``."""
    for rung in ladder:
        if rung == "float":
            return rung
        values = [e.errors.get(rung) for e in errors]
        if all(v is not None and v <= threshold for v in values):
            return rung
    return "float"


def _apart(got: float, wanted: float) -> str:
    """``got < wanted`` with as many digits as it takes to show they differ (not "1 < 1")."""
    for digits in range(4, 12):
        shown = f"{got:.{digits}g}", f"{wanted:.{digits}g}"
        if shown[0] != shown[1]:
            break
    return f"{shown[0]} < {shown[1]}"


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2] if ordered else 0.0


def meet_target(gm: fx.GraphModule, inputs: tuple, batches: list[tuple], backend: Any,
                mapping: QConfigMapping, target: Target, *, progress: bool | None = None,
                strict: bool = False, prepare_options: dict[str, Any] | None = None) -> fx.GraphModule:
    """Quantize the fused float ``gm`` keeping the fewest layers out of static int8 for ``target``."""
    from qplug_core.algorithms.pipeline import prepare_sharing_weights, quantize_fused
    from qplug_core.algorithms.reuse import calibrated_observers, observed_with
    from qplug_core.flows.steps import calibrate, convert_fx

    if not isinstance(target, Target):
        raise ConfigValidationError(f"target must be a qp.Target, got {type(target).__name__}",
                                    field="target", value=target)
    options = prepare_options or {}
    evaluation = _parse(target.data) or batches
    masks = padding_masks(gm, evaluation)
    layers = quantized_layers(gm, mapping)
    scored = _scored_ancestors(gm)
    names = {n.target: n.name for n in gm.graph.nodes if n.op == "call_module"}
    layers = [name for name in layers if names.get(name) in scored]
    ladder = target.ladder(backend)

    calibrated = prepare_sharing_weights(gm, mapping, inputs, backend, options)
    calibrate(calibrated, batches, progress=progress)
    # converted first (a copy: the layer errors read ``calibrated``'s observers), so the static
    # errors are those of the weights convert chose (8 or 7 bits per layer without VNNI)
    all_int8 = convert_fx(calibrated, backend=backend)
    snapshot = snapshot_of(all_int8)
    dynamic = backend.default_qconfig_mapping("dynamic").qconfig_for_module("", nn.Linear) \
        if "dynamic" in ladder else None
    weights = _static_weights(gm, mapping, layers,
                              converted_weight_ranges(snapshot.held) if snapshot else {})
    errors, reference = layer_errors(gm, calibrated, layers, evaluation, masks, static_weight=weights,
                                     dynamic_qconfig=dynamic, fallbacks=ladder,
                                     per_token_qmax=per_token_qmax(backend))
    sources = calibrated_observers(calibrated)
    embedding = target.score == "embedding" or (target.score == "auto"
                                                and is_embedding_output(reference, masks))
    count = 0

    def run(taken: dict[str, str]) -> tuple[fx.GraphModule, OutputScore, QConfigMapping]:
        nonlocal count
        count += 1
        m = mapping
        for fallback in ("float", "dynamic", "per_token"):
            chosen = [n for n, k in taken.items() if k == fallback]
            m = with_fallback(m, chosen, "dynamic" if fallback == "dynamic" else "float", backend, gm)
        if taken:
            observed = observed_with(gm, sources, m, inputs, batches, backend, options)
            if WEIGHT_BITS_DECIDED in all_int8.meta:  # the same calibrated layers: same weight bits
                observed.meta[WEIGHT_BITS_REUSE] = all_int8.meta[WEIGHT_BITS_DECIDED]
            # every layer may be out of static int8 (per-token layers are swapped in after)
            qmodel = convert_fx(observed, backend=backend, inplace=True, allow_float=True)
        else:
            qmodel = all_int8
        run_per_token(qmodel, [n for n, k in taken.items() if k == "per_token"],
                      simulate=not backend.kernels)
        name_fallbacks(qmodel, taken)
        return qmodel, score(qmodel, evaluation, reference, target.metric, masks,
                             embedding=embedding), m

    qmodel, base, final_mapping = run({})
    result = TargetResult(target, not target.misses(base), base, base, quantizations=0, errors=errors)
    search = _Search(run, target, layers, ladder, errors, result,
                     _Try(qmodel, base, final_mapping, [], 0, target.shortfall(base)))
    if not result.met and layers:
        taken = search.take_out()
        if not result.met and len(taken) == len(layers):
            search.escalate(taken)
        if target.cosine is not None and (search.best.out_of_static == len(layers) or not result.met):
            def scored(m: nn.Module) -> OutputScore:
                return score(m, evaluation, reference, None, masks, embedding=embedding)
            search.take_out_in_order(_alone_int8_cosines(gm, calibrated, all_int8, layers, scored),
                                     target.cosine)
    best = search.best
    qmodel, result.final, final_mapping, result.decisions = best.qmodel, best.score, best.mapping, best.decisions
    result.quantizations = count
    if not result.met:
        warn_user(_missed(target, result, len(layers), search.furthest) if layers
                  else _nothing_to_take_out(target, result))
    elif layers and len(result.float_layers) == len(layers):
        warn_user(_met_with_no_static_int8(result))
    if strict:  # the same ConfigValidationError as qp.quantize(strict=True) if anything is float
        qmodel = quantize_fused(gm, inputs, batches, backend, final_mapping, progress=progress,
                                strict=True, prepare_options=options)
    qmodel.meta[TARGET] = result
    return qmodel


#: a try of the search: the converted model, its score and the mapping it was converted with
Run = Callable[[dict[str, str]], tuple[fx.GraphModule, OutputScore, QConfigMapping]]


class _Search:
    """Which layers leave static int8: the doubling search over the ranked groups, then (when
    every layer is out and the target still misses) the escalation of the worst rungs to float.
    Both keep the best try, as ``_Try.or_better`` orders them, and set ``result.met``."""

    def __init__(self, run: Run, target: Target, layers: list[str], ladder: tuple[str, ...],
                 errors: list[LayerError], result: TargetResult, best: _Try) -> None:
        self.run, self.target, self.layers, self.ladder = run, target, layers, ladder
        self.result, self.best = result, best
        self.furthest = 0  # the most layers any try of the search took out of static int8
        self.by_name = {e.name: e for e in errors}

    @functools.cached_property
    def static(self) -> dict[str, float]:
        return {n: self.by_name[n].errors.get("static", 0.0) for n in self.layers}

    @functools.cached_property
    def median(self) -> float:
        return _median(list(self.static.values()))

    @functools.cached_property
    def ranked(self) -> list[list[str]]:
        """The candidate groups worst first: the groups worse than the median layer are tried
        first (taking out the rest buys little locally); if those are not enough, the others
        follow, since a layer's local error does not tell how much later layers amplify it
        (SwinV2's patch embedding and cosine attention)."""
        return sorted(group_layers(self.layers, self.target.group), key=lambda g: -self.group_static(g))

    def group_static(self, group: list[str]) -> float:
        return sum(self.static[n] for n in group) / len(group)

    def decision(self, sub: list[str], rung: str, why: str) -> Decision:
        return Decision(role_name(sub), tuple(sub), rung,
                        f"local static int8 error {self.group_static(sub):.2e}; as {rung}: "
                        f"{_group_error([self.by_name[n] for n in sub], rung):.2e}{why}")

    def _try(self, taken: dict[str, str], decisions: list[Decision]) -> bool:
        """Convert and score one try, keep it if it is the best so far; whether it met the target."""
        qmodel, final, mapping = self.run(taken)
        met = not self.target.misses(final)
        self.best = self.best.or_better(_Try(qmodel, final, mapping, decisions, len(taken),
                                             self.target.shortfall(final)))
        self.result.met = self.result.met or met
        return met

    def take_out(self) -> dict[str, str]:
        """Take the worst 1, 2, 4, ... groups out of static int8 until the target is met; the
        rungs of the last try."""
        ranked, static, median = self.ranked, self.static, self.median
        worse = sum(1 for g in ranked if self.group_static(g) > median)
        taken: dict[str, str] = {}
        for k in _sizes(worse, len(ranked)):
            out = ranked[:k]
            gone = {n for g in out for n in g}
            # a fallback must leave a layer no worse than the worst one staying in static int8;
            # with none staying, no worse than the median layer or its own static int8, whichever
            # is looser (a layer whose fallback beats its static int8 stays quantized rather
            # than sending the whole model toward float)
            staying = max((static[n] for n in self.layers if n not in gone), default=None)
            # each layer of a group takes its own first rung that passes: one layer of six over
            # the bar need not send the other five to float
            taken = {n: _rung([self.by_name[n]], self.ladder,
                              max(median, static[n]) if staying is None else staying)
                     for g in out for n in g}
            if len(taken) == len(self.layers) and set(taken.values()) == {"float"}:
                break  # the float model itself: not a quantization (the warning says so)
            self.furthest = len(taken)
            bar = (f"worst layer left in static int8: {staying:.2e}" if staying is not None
                   else f"no layer left in static int8; median layer {median:.2e}")
            if self._try(taken, [self.decision(sub, rung, f" ({bar})")
                                 for g in out for rung, sub in _by_rung(g, taken)]):
                break
        return taken

    def escalate(self, taken: dict[str, str]) -> None:
        """Every layer is out and its rung alone still misses: the rungs' own error is what is
        left (per-tensor dynamic on a CPU without VNNI), so the layers whose rung loses most go
        on to float, doubling, short of every layer float (the float model)."""
        rest = sorted((n for n in self.layers if taken[n] != "float"),
                      key=lambda n: -self.by_name[n].errors.get(taken[n], 0.0))
        for k in (k for k in _sizes(len(rest), len(rest)) if k < len(rest)):
            escalated = {**taken, **{n: "float" for n in rest[:k]}}
            if self._try(escalated, [self.decision(sub, rung, "" if before == rung else (
                    f"; float once every layer was out of static int8 and the target still missed "
                    f"(as {before}: {_group_error([self.by_name[n] for n in sub], before):.2e})"))
                    for g in self.ranked for (rung, before), sub in _by_rung(g, escalated, taken)]):
                break

    def take_out_in_order(self, cosines: dict[str, float], want: float) -> None:
        """The search again when the local errors ended with every layer out of static int8 (or
        still missing), for a target with a cosine ``want``: the layers ranked by the output's
        cosine with each alone static int8, lowest first, and the first k of them float, k from
        where those cosines' losses, added, predict ``want``, then galloping to the fewest that
        meet it (short of all: that is the float model). Local errors do not see amplification:
        SwinV2's patch embedding has a local error like any other layer's but costs the output
        more than the whole target allows, and its first stage's layers 5x what its second's do."""
        order = sorted(self.layers, key=lambda n: cosines[n])
        losses = [1.0 - cosines[n] for n in order]
        last = len(order) - 1
        first = next((k for k in range(1, last) if 1.0 - sum(losses[k:]) >= want), last)
        missed, met, k, step = 0, last + 1, first, 1
        while met - missed > 1:
            out = order[:k]
            if self._try(dict.fromkeys(out, "float"), [self.decision(
                    [n], "float", f" (output cosine {cosines[n]:.5f} with it alone static int8)") for n in out]):
                met, k = k, k - step
            else:
                missed, k = k, k + step
            step *= 2
            if not missed < k < met:
                k = (missed + met) // 2


@dataclass
class _Try:
    """One converted model of the search, with what makes it better or worse than another."""

    qmodel: fx.GraphModule
    score: OutputScore
    mapping: QConfigMapping
    decisions: list[Decision]
    out_of_static: int  # layers out of static int8: fewer run faster
    shortfall: tuple[int, float]

    def or_better(self, other: _Try) -> _Try:
        """``other`` if it comes closer to the target than this one (a try that meets it is as
        close as can be), or as close with fewer layers out of static int8; else this one (the
        best model found is returned when the target is missed)."""
        if (other.shortfall, other.out_of_static) < (self.shortfall, self.out_of_static):
            return other
        return self


def _alone_int8_cosines(gm: fx.GraphModule, calibrated: fx.GraphModule, all_int8: fx.GraphModule,
                        layers: list[str], scored: Callable[[nn.Module], OutputScore]) -> dict[str, float]:
    """layer -> the output cosine of the float model with that layer alone static int8 (on the
    weight bits convert chose): one pass over the data per layer (:mod:`.layer_switches`)."""
    from qplug_core.flows.steps import convert_to_reference_fx

    if WEIGHT_BITS_DECIDED in all_int8.meta:
        calibrated.meta[WEIGHT_BITS_REUSE] = all_int8.meta[WEIGHT_BITS_DECIDED]
    int8_form = convert_to_reference_fx(calibrated)
    calibrated.meta.pop(WEIGHT_BITS_REUSE, None)
    scores = alone_int8_scores(gm, int8_form, layers, [[n] for n in layers], scored)
    return {n: s.cosine_mean for n, s in zip(layers, scores)}


def _sizes(first: int, total: int) -> list[int]:
    """How many of the ranked groups each try takes out: doubling up to ``first`` (the groups
    worse than the median layer), then doubling on to ``total``."""
    sizes: list[int] = []
    k = 1
    while k <= total:
        sizes.append(k)
        if k == total:
            break
        k = min(2 * k, first) if k < first else min(2 * k, total)
    return sizes


def _missed(target: Target, result: TargetResult, layers: int, furthest: int) -> str:
    """The warning for a target the search could not meet: the model returned (the best found)
    and what was left to try (``furthest``: the most layers a try took out of static int8)."""
    taken = len(result.float_layers)
    rungs = ", ".join(sorted({d.fallback for d in result.decisions}))
    returned = (f"the model returned is the best of the {result.quantizations} tried (fewest criteria "
                "missed, then the smallest miss, then the most layers in static int8): "
                + (f"{taken} of {layers} layer(s) out of static int8 (as {rungs})" if taken
                   else "the all-int8 model, as no try came closer")
                + f", missing {'; '.join(target.misses(result.final))}")
    if furthest < layers:
        return (f"{TARGET_MISSED} even with {furthest} of {layers} layer(s) out of static "
                f"int8; {returned}; the next step would have left every layer float, which is the "
                "float model, not a quantization")
    return (f"{TARGET_MISSED} even with every weighted layer ({layers}) out of static int8; "
            f"{returned}. The rest of the loss is in the fallbacks and in the int8 ops without weights "
            "(matmuls, adds); qp.compare(float_model, qmodel, data) shows where; a qconfig_mapping "
            "leaving those ops float goes further")


def _nothing_to_take_out(target: Target, result: TargetResult) -> str:
    """The warning for a missed target when no layer can be ranked: the search had nothing to try."""
    return (f"{TARGET_MISSED}: the target search found no layer it can take out of static int8 (it "
            "ranks the static int8 Linear and Conv1d/2d/3d layers, bare or fused with a ReLU, that the "
            f"scored output depends on); the model returned is the all-int8 model, missing "
            f"{'; '.join(target.misses(result.final))}. A qconfig_mapping leaving the layers that hurt "
            "float goes further; qp.compare(float_model, qmodel, data) shows which")


def _met_with_no_static_int8(result: TargetResult) -> str:
    """The warning for a target met only by taking every weighted layer out of static int8: such a
    model is rarely faster than float, which the user should know before shipping it."""
    rungs = ", ".join(f"{sum(len(d.layers) for d in result.decisions if d.fallback == rung)} {rung}"
                      for rung in sorted({d.fallback for d in result.decisions}))
    return (f"qplug: the accuracy target was met only with every weighted layer "
            f"({len(result.float_layers)}) out of static int8 ({rungs}): the model is likely no faster "
            "than float. recipe='none' keeps every layer static int8 (check it with qp.compare), or pass "
            "a qp.Target this model and calibration data can meet in int8")


def _by_rung(group: list[str], taken: dict[str, str], before: dict[str, str] | None = None) -> list:
    """The layers of ``group`` by the rung each took, in order of first use; with ``before``
    (the rungs of an earlier try), by the pair (rung now, rung before)."""
    subgroups: dict[Any, list[str]] = {}
    for name in group:
        key = taken[name] if before is None else (taken[name], before[name])
        subgroups.setdefault(key, []).append(name)
    return list(subgroups.items())


def _group_error(errors: list[LayerError], rung: str) -> float:
    return 0.0 if rung == "float" else sum(e.errors.get(rung, 0.0) for e in errors) / len(errors)


def _static_weights(gm: fx.GraphModule, mapping: QConfigMapping, layers: list[str],
                    converted: dict[str, tuple[int, int]]) -> dict[str, Any]:
    """layer name -> the weight observer factory ``mapping`` gives it, on the integer range its
    weights were ``converted`` to where convert chose another (``flows/weight_bits.py``)."""
    modules = dict(gm.named_modules(remove_duplicate=False))
    wanted, counter, found = set(layers), CallCounter(), {}
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target in wanted and node.target not in found:
            factory = resolve_qconfig(mapping, node, modules, counter).weight
            chosen = converted.get(node.target)
            if factory is not None and chosen is not None:
                own = factory()
                if chosen != (own.quant_min, own.quant_max):
                    factory = functools.partial(factory, quant_min=chosen[0], quant_max=chosen[1])
            found[node.target] = factory
    return found
