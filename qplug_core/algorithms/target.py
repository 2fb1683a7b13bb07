"""Accuracy targets: ``qp.quantize(..., target=qp.Target(cosine=0.99))``.

The model is quantized fully int8 first; if its output misses the target, each weighted layer
(or role group, see :mod:`.sensitivity`) is measured with only itself taken out of static int8,
and layers are taken out in order of what that buys until the target is met, so the fewest
layers leave int8. "Taken out" is ``fallback="dynamic"`` by default: a Linear keeps int8 weights
and quantizes its input at run time with a float output (no calibrated output scale to crush a
residual stream's outlier channels), anything else stays float; ``fallback="float"`` keeps them
all float. The result records which layers and why in ``qmodel.meta["qplug_target"]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import fx

from qplug_core.algorithms.sensitivity import (
    FALLBACKS,
    GROUPS,
    OutputScore,
    float_outputs,
    group_layers,
    padding_masks,
    quantized_layers,
    role_name,
    score,
    with_fallback,
)
from qplug_core.config import QConfigMapping
from qplug_core.errors import ConfigValidationError, QplugError, warn_user
from qplug_core.flows.tags import TARGET

__all__ = ["TARGET", "TRANSFORMER_TARGET", "Target", "TargetResult", "meet_target"]


@dataclass(frozen=True)
class Target:
    """What the quantized model's output must reach against float, on ``data`` (default: the
    calibration data): mean per-sample ``cosine``, worst-sample ``min_cosine``, output ``sqnr``
    in dB, and/or ``metric(reference_outputs, quantized_outputs) >= minimum``. When the model
    has an ``attention_mask`` input (Hugging Face's convention), padded tokens are left out of
    the cosine and the SQNR: nothing downstream reads them.
    """

    cosine: float | None = None
    min_cosine: float | None = None
    sqnr: float | None = None
    metric: Callable[[list, list], float] | None = None
    minimum: float | None = None
    data: Any = None
    fallback: str = "dynamic"
    group: str = "role"

    def __post_init__(self) -> None:
        if all(v is None for v in (self.cosine, self.min_cosine, self.sqnr, self.metric)):
            raise ConfigValidationError("Target needs cosine=, min_cosine=, sqnr= or metric=",
                                        field="Target")
        if (self.metric is None) != (self.minimum is None):
            raise ConfigValidationError("Target(metric=...) and minimum= go together: the metric "
                                        "must reach minimum", field="minimum", value=self.minimum)
        if self.metric is not None and not callable(self.metric):
            raise ConfigValidationError("Target.metric must be a function (reference outputs, "
                                        "quantized outputs) -> float", field="metric")
        for name in ("cosine", "min_cosine"):
            value = getattr(self, name)
            if value is not None and not -1.0 <= value <= 1.0:
                raise ConfigValidationError(f"Target.{name} must be in [-1, 1], got {value}",
                                            field=name, value=value)
        if self.fallback not in FALLBACKS:
            raise ConfigValidationError(f"Target.fallback must be one of {FALLBACKS}, got "
                                        f"{self.fallback!r}", field="fallback", value=self.fallback)
        if self.group not in GROUPS:
            raise ConfigValidationError(f"Target.group must be one of {GROUPS}, got {self.group!r}",
                                        field="group", value=self.group)

    def misses(self, s: OutputScore) -> list[str]:
        """Which criteria ``s`` fails, as readable text (empty: the target is met)."""
        checks = [("cosine", self.cosine, s.cosine_mean), ("min_cosine", self.min_cosine, s.cosine_min),
                  ("sqnr", self.sqnr, s.sqnr_db), ("metric", self.minimum, s.metric)]
        return [f"{name} {got:.4g} < {want:.4g}" for name, want, got in checks
                if want is not None and not got >= want]


#: what ``recipe="auto"`` aims for on a transformer when no target is given (on calibration data)
#: Tighter than the figures users are promised (0.99 / 0.98 on unseen sentences): on
#: all-MiniLM-L6-v2 a 0.99 target keeps 91-94% of nearest neighbours depending on the sentence
#: split, 0.997 keeps 92-98% at the same speed (the FFN's two linears go dynamic instead of one).
TRANSFORMER_TARGET = Target(cosine=0.997, min_cosine=0.99)


@dataclass
class Decision:
    """Layers taken out of static int8, how, and what taking them out alone measured."""

    name: str
    layers: tuple[str, ...]
    fallback: str
    reason: str


@dataclass
class TargetResult:
    """Whether the target was met, the final score, and the layers taken out of static int8."""

    target: Target
    met: bool
    all_int8: OutputScore
    final: OutputScore
    decisions: list[Decision] = field(default_factory=list)
    quantizations: int = 0

    @property
    def float_layers(self) -> list[str]:
        return [name for d in self.decisions for name in d.layers]


def _improves(alone: OutputScore, base: OutputScore) -> bool:
    """Whether taking a layer out alone moved any score above the all-int8 model's."""
    pairs = [(alone.cosine_mean, base.cosine_mean), (alone.cosine_min, base.cosine_min),
             (alone.sqnr_db, base.sqnr_db), (alone.metric, base.metric)]
    return any(a is not None and b is not None and a > b for a, b in pairs)


def _parse(data: Any) -> list[tuple] | None:
    if data is None:
        return None
    from qplug_core.flows.steps import iter_batches
    return list(iter_batches(data))


def meet_target(gm: fx.GraphModule, inputs: tuple, batches: list[tuple], backend: Any,
                mapping: QConfigMapping, target: Target, *, progress: bool | None = None,
                strict: bool = False, prepare_options: dict[str, Any] | None = None) -> fx.GraphModule:
    """Quantize the fused float ``gm`` keeping the fewest layers out of static int8 for ``target``."""
    from qplug_core.algorithms.pipeline import quantize_fused

    if not isinstance(target, Target):
        raise ConfigValidationError(f"target must be a qp.Target, got {type(target).__name__}",
                                    field="target", value=target)
    evaluation = _parse(target.data) or batches
    reference, masks = float_outputs(gm, evaluation), padding_masks(gm, evaluation)
    count = 0

    final_mapping = mapping

    def run(m: QConfigMapping) -> tuple[fx.GraphModule, OutputScore]:
        nonlocal count, final_mapping
        count += 1
        final_mapping = m
        qmodel = quantize_fused(gm, inputs, batches, backend, m, progress=progress,
                                prepare_options=prepare_options)
        return qmodel, score(qmodel, evaluation, reference, target.metric, masks)

    def out_of_int8(kinds: dict[str, str]) -> QConfigMapping:
        m = mapping
        for fallback in FALLBACKS:
            m = with_fallback(m, [n for n, k in kinds.items() if k == fallback], fallback, backend, gm)
        return m

    def run_with_fallback(layers: list[str], kinds: dict[str, str]) -> tuple[Any, OutputScore, str]:
        """Quantize with ``layers`` out of int8; a dynamic fallback the flow cannot build (a
        dynamic linear fed by a tensor that static int8 ops around it quantize) becomes float."""
        fallback = target.fallback
        try:
            return (*run(out_of_int8({**kinds, **dict.fromkeys(layers, fallback)})), fallback)
        except QplugError:
            if fallback == "float":
                raise
        return (*run(out_of_int8({**kinds, **dict.fromkeys(layers, "float")})), "float")

    qmodel, base = run(mapping)
    result = TargetResult(target, not target.misses(base), base, base)
    if not result.met:
        measured = []
        for layers in group_layers(quantized_layers(gm, mapping), target.group):
            _, alone, fallback = run_with_fallback(layers, {})
            measured.append((alone, layers, fallback))
        measured.sort(key=lambda item: (len(target.misses(item[0])), -item[0].cosine_mean,
                                        -item[0].sqnr_db))
        taken: dict[str, str] = {}
        for alone, layers, fallback in measured:
            if not _improves(alone, base):  # e.g. a layer whose output the scored output never reads
                continue
            taken.update(dict.fromkeys(layers, fallback))
            result.decisions.append(Decision(
                role_name(layers), tuple(layers), fallback,
                f"alone out of int8: cosine {alone.cosine_mean:.4f} (all int8 {base.cosine_mean:.4f}), "
                f"SQNR {alone.sqnr_db:.1f} dB (all int8 {base.sqnr_db:.1f})"))
            qmodel, result.final = run(out_of_int8(taken))
            if not target.misses(result.final):
                result.met = True
                break
    result.quantizations = count
    if not result.met:
        warn_user(f"qplug: accuracy target not met even with {len(result.float_layers)} layer(s) "
                  f"out of static int8: {'; '.join(target.misses(result.final))}")
    if strict:  # the same ConfigValidationError as qp.quantize(strict=True) if anything is float
        qmodel = quantize_fused(gm, inputs, batches, backend, final_mapping, progress=progress,
                                strict=True, prepare_options=prepare_options)
    qmodel.meta[TARGET] = result
    return qmodel
