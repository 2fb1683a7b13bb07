"""Numeric comparison of a float model and its quantized version, layer by layer.

Accuracy on a task says *whether* quantization hurt; this report says *where*. Both models run on
the same inputs while forward hooks copy the output of every submodule that exists under the same
qualified name in both (flows keep the float model's names for the modules they convert), and the
error of each pair is summarised as SQNR, max absolute error, relative L2 error and cosine
similarity, accumulated over all batches.

A fused kernel (``conv1`` computing conv+bn+relu) is compared against the float module of the same
name, which computes only its first op; pass the *fused* float model (``fuse_fx`` output) for
pairs that compute the same thing. A layer whose int8 output range holds a clamp convert dropped
(ReLU6 after a conv, see :mod:`qplug_core.flows.clamps`) is compared against the float value after
that clamp, its float type naming it (``Conv2d+ReLU6``); so is a layer that computes a ReLU fused
into it or a frozen BatchNorm folded into it, where the float model runs them after it
(:mod:`qplug_core.analysis.followers`: ``Linear+ReLU``, ``Conv2d+affine``). Float leaf modules with no counterpart (not
the children of a fused module the quantized model computes whole, nor an op a layer computes) are listed
in ``ComparisonReport.float_only`` as a hint.

A layer the quantized model made from a functional call (``F.conv2d(x, self.w)`` became
``conv2d_module``) has no float module to hook: it is paired with the float call on the same weight
(:mod:`qplug_core.analysis.functional`), its float type naming the call (``F.conv2d+relu6``), or
listed in ``skipped`` with the reason it could not be.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text
from torch import nn

from qplug_core.analysis.absent import NOT_FOUND, absent_kinds
from qplug_core.analysis.absent import summary as absent_summary
from qplug_core.analysis.followers import Followers, layer_followers
from qplug_core.analysis.functional import FunctionalRecorder, functional_layers, never_called
from qplug_core.analysis.plain_text import plain_text
from qplug_core.errors import (
    ConfigError,
    ConfigValidationError,
    InputMismatchError,
    QplugError,
    did_you_mean,
    first_line,
)
from qplug_core.flows.clamps import AbsorbedClamp, absorbed_clamps
from qplug_core.flows.float_reference import float_like_int8
from qplug_core.flows.pipeline import as_input_tuple, eval_mode
from qplug_core.kernels.reference import ReferenceWeighted

__all__ = ["ComparisonReport", "LayerComparison", "compare_layers", "sqnr"]

SCHEMA_VERSION = 1
#: SQNR at or above which a layer is shown as healthy (int8 of well-behaved tensors reaches 35-45)
GOOD_SQNR_DB = 30.0
#: SQNR below which a layer is shown as a problem
POOR_SQNR_DB = 20.0


def _as_float64(t: torch.Tensor) -> torch.Tensor:
    """Plain float64 copy of ``t``; torch quantized tensors are dequantized first."""
    if t.is_quantized:
        t = t.dequantize()
    return t.detach().to(torch.float64)


class ErrorStats:
    """Running sums over (reference, test) pairs, so that many batches give one exact figure."""

    def __init__(self) -> None:
        self.ref2 = 0.0
        self.test2 = 0.0
        self.err2 = 0.0
        self.dot = 0.0
        self.max_abs = 0.0

    def update(self, reference: torch.Tensor, test: torch.Tensor) -> ErrorStats:
        ref, tst = _as_float64(reference), _as_float64(test)
        err = ref - tst
        self.ref2 += float(ref.square().sum())
        self.test2 += float(tst.square().sum())
        self.err2 += float(err.square().sum())
        self.dot += float((ref * tst).sum())
        if err.numel():
            self.max_abs = max(self.max_abs, float(err.abs().max()))
        return self

    @property
    def sqnr_db(self) -> float:
        if math.isnan(self.ref2) or math.isnan(self.err2):
            return math.nan
        if self.err2 == 0.0:
            return math.inf
        if self.ref2 == 0.0:
            return -math.inf
        return 10.0 * math.log10(self.ref2 / self.err2)

    @property
    def rel_l2_err(self) -> float:
        if self.ref2 == 0.0:
            return 0.0 if self.err2 == 0.0 else math.inf
        return math.sqrt(self.err2 / self.ref2)

    @property
    def cosine(self) -> float:
        norms = math.sqrt(self.ref2 * self.test2)
        if norms == 0.0:
            return 1.0 if self.err2 == 0.0 else 0.0
        return self.dot / norms


def _check_shapes(reference: torch.Tensor, test: torch.Tensor, what: str) -> None:
    for name, value in (("reference", reference), ("test", test)):
        if not isinstance(value, torch.Tensor):
            raise ConfigValidationError(f"{what}: {name} must be a torch.Tensor, got {type(value).__name__}; "
                                        "pass tensors (torch.as_tensor(...) converts a list)",
                                        field=name, value=type(value).__name__)
    if reference.shape != test.shape:
        raise ConfigError(
            f"{what}: shapes differ, reference {tuple(reference.shape)} vs test "
            f"{tuple(test.shape)}; compare tensors of the same shape", field="test")


def sqnr(reference: torch.Tensor, test: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio ``20*log10(||ref|| / ||ref - test||)`` in dB.

    ``inf`` when the tensors are equal, ``-inf`` when ``reference`` is all zeros and ``test`` is
    not, ``nan`` when either holds NaN. Torch quantized tensors are dequantized first.
    """
    _check_shapes(reference, test, "sqnr")
    return ErrorStats().update(reference, test).sqnr_db


def _json_float(x: float) -> float | str:
    """JSON has no inf/nan: encode them as the strings ``float()`` parses back."""
    return x if math.isfinite(x) else str(x)


@dataclass(frozen=True)
class LayerComparison:
    """Error of one submodule's output, over every call in every batch."""

    name: str
    float_type: str
    quant_type: str
    sqnr_db: float
    max_abs_err: float
    rel_l2_err: float
    cosine: float
    shape: tuple[int, ...]
    num_outputs: int
    #: a compiled partition only: SQNR of its output against its reference form (same inputs)
    reference_sqnr_db: float | None = None
    #: a compiled partition with integer or bool outputs (topk indices, argmax masks): the fraction
    #: of their elements equal to the float form's; the SQNR figures are of its float outputs only
    integer_agreement: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: _json_float(v) if isinstance(v, float) else v for k, v in asdict(self).items()}


def _worst_first(layer: LayerComparison) -> tuple[bool, float]:
    return (not math.isnan(layer.sqnr_db), layer.sqnr_db)


@dataclass(frozen=True)
class ComparisonReport:
    """Per-layer and end-to-end error of a quantized model against its float original.

    ``layers`` follows the float model's execution order. ``skipped`` maps names present in both
    models (or layers made from a functional call) whose outputs could not be paired to the reason;
    ``float_only`` lists float leaf modules missing from the quantized model, ``float_only_kinds``
    what each became (:func:`qplug_core.analysis.absent.absent_kinds`: a no-op at inference, fused
    into a layer, run as a function).
    """

    layers: list[LayerComparison]
    output_sqnr_db: float
    output_cosine: float
    output_max_abs_err: float
    num_batches: int
    skipped: dict[str, str] = field(default_factory=dict)
    float_only: list[str] = field(default_factory=list)
    float_only_kinds: dict[str, str] = field(default_factory=dict)

    def worst(self, n: int = 5) -> list[LayerComparison]:
        """The ``n`` layers with the lowest SQNR (NaN counts as worst)."""
        return sorted(self.layers, key=_worst_first)[:n]

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe summary; non-finite numbers become the strings "inf", "-inf", "nan"."""
        return {
            "schema_version": SCHEMA_VERSION,
            "num_batches": self.num_batches,
            "output": {"sqnr_db": _json_float(self.output_sqnr_db),
                       "cosine": _json_float(self.output_cosine),
                       "max_abs_err": _json_float(self.output_max_abs_err)},
            "layers": [layer.to_dict() for layer in self.layers],
            "skipped": dict(self.skipped),
            "float_only": list(self.float_only),
            "float_only_kinds": dict(self.float_only_kinds),
        }

    def __rich__(self) -> RenderableType:
        worst = {layer.name for layer in self.worst(5) if layer.sqnr_db != math.inf}
        table = Table(title="quantized vs float, per layer", title_justify="left")
        table.add_column("layer", overflow="fold")
        for column in ("float", "quantized"):
            table.add_column(column, max_width=20, overflow="ellipsis")
        partitions = any(layer.reference_sqnr_db is not None for layer in self.layers)
        integers = any(layer.integer_agreement is not None for layer in self.layers)
        for column in ("SQNR dB", *(("vs ref dB",) if partitions else ()), "max |err|", "rel L2",
                       *(("ints equal",) if integers else ())):
            table.add_column(column, justify="right")
        for layer in self.layers:
            vs_reference = (() if not partitions else ("" if layer.reference_sqnr_db is None
                                                       else f"{layer.reference_sqnr_db:.1f}",))
            agreement = (() if not integers else ("" if layer.integer_agreement is None
                                                  else f"{layer.integer_agreement:.1%}",))
            table.add_row(layer.name, layer.float_type, layer.quant_type,
                          Text(f"{layer.sqnr_db:.1f}", style=_sqnr_style(layer.sqnr_db)),
                          *vs_reference, f"{layer.max_abs_err:.3g}", f"{layer.rel_l2_err:.3g}",
                          *agreement, style="bold" if layer.name in worst else None)
        summary = Text.assemble(
            "output: SQNR ", (f"{self.output_sqnr_db:.1f} dB", _sqnr_style(self.output_sqnr_db)),
            f", cosine {self.output_cosine:.6f}, max |err| {self.output_max_abs_err:.3g}"
            f" over {self.num_batches} batch(es)")
        notes = []
        if self.skipped:
            notes.append(Text(f"{len(self.skipped)} layer(s) not compared "
                              "(see .skipped)", style="dim"))
        if self.float_only:
            kinds = {name: self.float_only_kinds.get(name, NOT_FOUND) for name in self.float_only}
            unknown = NOT_FOUND in kinds.values()
            notes.append(Text(f"{len(self.float_only)} float module(s) without a counterpart in the quantized "
                              f"model: {absent_summary(kinds)}"
                              + ("; compare against the fused float model for exact pairs" if unknown else ""),
                              style="yellow" if unknown else "dim"))
        return Group(table, summary, *notes)

    def print(self, console: Console | None = None) -> None:
        """Render the table to ``console`` (a new stdout console by default)."""
        (console or Console()).print(self)

    def __str__(self) -> str:
        """The table as ``print(report)`` shows it (80 columns), not the dataclass fields."""
        return plain_text(self)


def _sqnr_style(db: float) -> str:
    if db >= GOOD_SQNR_DB:
        return "green"
    return "yellow" if db >= POOR_SQNR_DB else "bold red"


# -- running the models ----------------------------------------------------------------------------


def first_tensor(obj: Any) -> torch.Tensor | None:
    """The first tensor in a (possibly nested) output: LSTMs return ``(out, (h, c))``."""
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    for item in obj if isinstance(obj, (tuple, list)) else ():
        found = first_tensor(item)
        if found is not None:
            return found
    return None


def batches_of(inputs: Any, model: nn.Module | None = None) -> Iterator[tuple[Any, ...]]:
    """A tuple is one batch of positional args, a tensor a 1-tuple, anything else an iterable; a
    dict of keyword inputs is refused with qplug's error (:func:`as_input_tuple`), which reads
    ``model``'s forward() to say how to pass it."""
    if isinstance(inputs, (tuple, torch.Tensor)) or hasattr(inputs, "keys"):
        inputs = [inputs]
    try:
        iterator = iter(inputs)
    except TypeError:
        raise ConfigError(
            f"inputs must be a tuple of positional args or an iterable of such tuples, "
            f"got {type(inputs).__name__}", field="inputs") from None
    for batch in iterator:
        yield as_input_tuple(batch, model)


class _Recorder:
    """Forward hooks that copy the first output tensor of each named module, call by call.

    Copies are taken at hook time because later in-place ops (``out += identity``, ReLU with
    ``inplace=True``) would otherwise rewrite what was recorded. ``followers`` (name -> the ops after
    it its int8 layer computes) are applied to the copies of those modules: the float side of that layer.
    """

    def __init__(self, model: nn.Module, names: Iterable[str],
                 followers: Mapping[str, Followers] | None = None) -> None:
        self.outputs: dict[str, list[torch.Tensor]] = {}
        modules = dict(model.named_modules())
        followers = followers or {}
        self._handles = [modules[n].register_forward_hook(self._hook(n, followers.get(n))) for n in names]

    def _hook(self, name: str, after: Followers | None) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            t = first_tensor(output)
            if t is not None and (t.is_quantized or t.is_floating_point()):
                snapshot = t.dequantize() if t.is_quantized else t.detach().clone()
                self.outputs.setdefault(name, []).append(snapshot if after is None else after.apply(snapshot))
        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


@contextmanager
def _recording(model: nn.Module, names: Iterable[str],
               followers: Mapping[str, Followers] | None = None) -> Iterator[_Recorder]:
    recorder = _Recorder(model, names, followers)
    try:
        yield recorder
    finally:
        recorder.remove()


def _select_layers(float_model: nn.Module, quantized_model: nn.Module,
                   layers: Iterable[str] | str | None, functional: Iterable[str]) -> list[str]:
    """The layers to hook: common module names, and the ``functional`` layers (made from calls)."""
    quant_names = {n for n, _ in quantized_model.named_modules()}
    common = [n for n, _ in float_model.named_modules() if n and n in quant_names] + list(functional)
    if layers is None:
        return common
    requested = [layers] if isinstance(layers, str) else list(layers)
    for name in requested:
        if name not in common:
            raise ConfigError(
                f"layer {name!r} is not a submodule of both models nor a functional call of the float "
                f"model{did_you_mean(name, common)}", field="layers", value=name)
    return requested


def _pairing_problem(ref: list[torch.Tensor] | None, test: list[torch.Tensor] | None) -> str | None:
    """Why two output lists of one module cannot be paired, or None when they can."""
    if test is None:
        return "not run by the quantized model"
    if ref is None:
        return NOT_RUN_BY_FLOAT
    if len(ref) != len(test):
        return f"called {len(ref)} time(s) by the float model, {len(test)} by the quantized one"
    for r, t in zip(ref, test):
        if r.shape != t.shape and not _same_rows(r, t):
            return f"output shapes differ: {tuple(r.shape)} vs {tuple(t.shape)}"
    return None


def _same_rows(ref: torch.Tensor, test: torch.Tensor) -> bool:
    """Whether ``test`` holds ``ref``'s rows with the leading dims flattened: a layer raised from a
    2-D matmul on ``x.view(-1, features)`` (GPT-2's Conv1D under torch.export) outputs (B*T, C)
    where the float module returns the (B, T, C) view of it."""
    return (ref.dim() > test.dim() >= 2 and ref.shape[-1] == test.shape[-1]
            and ref.numel() == test.numel())


#: why a layer that the quantized model ran has no float output: the float model never ran its module
NOT_RUN_BY_FLOAT = "not run by the float model"


class _LayerErrors:
    """Per-layer error sums across batches (in first-seen order) and the layers left unpaired."""

    def __init__(self) -> None:
        self.stats: dict[str, ErrorStats] = {}
        self.num_outputs: dict[str, int] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.skipped: dict[str, str] = {}

    def add_batch(self, ref_outputs: dict[str, list[torch.Tensor]],
                  test_outputs: dict[str, list[torch.Tensor]]) -> None:
        for name in [*ref_outputs, *(n for n in test_outputs if n not in ref_outputs)]:
            if name in self.skipped:
                continue
            ref, test = ref_outputs.get(name), test_outputs.get(name)
            problem = _pairing_problem(ref, test)
            if problem is not None:
                self.skipped[name] = problem
                self.stats.pop(name, None)
                continue
            layer = self.stats.setdefault(name, ErrorStats())
            for r, t in zip(ref, test):
                layer.update(r, t.reshape(r.shape))
            self.num_outputs[name] = self.num_outputs.get(name, 0) + len(ref)
            self.shapes.setdefault(name, tuple(ref[0].shape))

    def comparisons(self, float_model: nn.Module, quantized_model: nn.Module,
                    followers: Mapping[str, Followers], functions: Mapping[str, str]) -> list[LayerComparison]:
        """The rows; ``functions``: the float function (``F.conv2d``) of each layer made from a call."""
        float_modules = dict(float_model.named_modules())
        quant_modules = dict(quantized_model.named_modules())
        return [LayerComparison(
            name=name, float_type=(functions.get(name) or type(float_modules[name]).__name__)
            + (followers[name].ops if name in followers else ""),
            quant_type=_quant_type(float_modules.get(name), quant_modules[name]), sqnr_db=s.sqnr_db,
            max_abs_err=s.max_abs, rel_l2_err=s.rel_l2_err, cosine=s.cosine,
            shape=self.shapes[name], num_outputs=self.num_outputs[name])
            for name, s in self.stats.items()]


def _quant_type(float_module: nn.Module | None, quant_module: nn.Module) -> str:
    """The int8 module's type; a kernel computing a whole fused module (a conv kernel whose
    output range holds the fused ReLU) is named after the fused module it computes."""
    name = type(quant_module).__name__
    if (isinstance(float_module, nn.Sequential) and len(float_module) > 1
            and name == type(float_module[0]).__name__):
        return type(float_module).__name__
    return name


def _run(model: nn.Module, args: tuple, which: str, index: int) -> Any:
    """``model(*args)``; torch's error for inputs that do not fit becomes qplug's, naming the model."""
    try:
        return model(*args)
    except QplugError:
        raise
    except Exception as error:
        raise InputMismatchError(f"compare(): the {which} model raised on batch {index}: "
                                 f"{type(error).__name__}: {first_line(error)}. The usual causes: inputs shaped "
                                 "unlike the model's example inputs, or a float model that is not the one "
                                 "the quantized model came from") from error


def compare_layers(float_model: nn.Module, quantized_model: nn.Module, inputs: Any, *,
            layers: Iterable[str] | str | None = None) -> ComparisonReport:
    """Run both models on ``inputs`` and report per-layer and output error.

    ``inputs`` is one tuple of positional args, a bare tensor, or an iterable of such batches (a
    list, a DataLoader). ``layers`` restricts the hooked modules (default: every module with the
    same qualified name in both models, and every layer made from a functional call). Both models
    run in eval mode without gradients; their modes are restored and every hook removed afterwards,
    so neither model is modified.
    """
    functional, unpaired = functional_layers(float_model, quantized_model)
    names = _select_layers(float_model, quantized_model, layers, functional)
    functional = {name: weight for name, weight in functional.items() if name in names}
    clamps = absorbed_clamps(quantized_model)
    followers = layer_followers(float_model, quantized_model, _clamped_outputs(quantized_model, clamps))
    errors = _LayerErrors()
    if layers is None:
        errors.skipped.update(unpaired)
    output = ErrorStats()
    num_batches = 0
    with ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(float_like_int8(float_model))
        stack.enter_context(eval_mode(float_model))
        stack.enter_context(eval_mode(quantized_model))
        ref_rec = stack.enter_context(_recording(float_model, [n for n in names if n not in functional], followers))
        calls = FunctionalRecorder(functional, followers, ref_rec.outputs)
        test_rec = stack.enter_context(_recording(quantized_model, names))
        for args in batches_of(inputs, float_model):
            with calls if functional else nullcontext():  # the mode costs a Python call per torch call
                ref_out = first_tensor(_run(float_model, args, "float", num_batches))
            test_out = first_tensor(_run(quantized_model, args, "quantized", num_batches))
            if ref_out is None or test_out is None:
                raise ConfigError("a model returned no tensor; compare() needs tensor outputs",
                                  field="inputs")
            _check_shapes(ref_out, test_out, "model outputs")
            output.update(ref_out, test_out)
            errors.add_batch(ref_rec.outputs, test_rec.outputs)
            ref_rec.outputs.clear()
            test_rec.outputs.clear()
            num_batches += 1
    if num_batches == 0:
        raise ConfigError("compare() got no input batches", field="inputs")
    for name in functional:
        if errors.skipped.get(name) == NOT_RUN_BY_FLOAT:
            errors.skipped[name] = never_called(name, quantized_model)
    float_only = _float_only(float_model, quantized_model, {c.module for c in clamps.values()}.union(
        *(after.modules for after in followers.values())))
    return ComparisonReport(
        layers=errors.comparisons(float_model, quantized_model, followers, calls.functions),
        output_sqnr_db=output.sqnr_db, output_cosine=output.cosine,
        output_max_abs_err=output.max_abs, num_batches=num_batches, skipped=errors.skipped,
        float_only=float_only, float_only_kinds=absent_kinds(float_model, quantized_model, float_only))


def _clamped_outputs(quantized_model: nn.Module, clamps: Mapping[str, AbsorbedClamp]
                     ) -> dict[str, AbsorbedClamp]:
    """The absorbed clamps of the layers whose int8 module outputs the clamped value: a kernel
    quantizes its output, whose range holds the clamp; a layer in reference form outputs the float
    value the Quantize after it clamps, which is compared with the float layer's as it is."""
    modules = dict(quantized_model.named_modules())
    return {name: clamp for name, clamp in clamps.items() if not isinstance(modules.get(name), ReferenceWeighted)}


def _float_only(float_model: nn.Module, quantized_model: nn.Module, absorbed: set[str | None]) -> list[str]:
    """Float leaf modules without a counterpart in the quantized model. The children of a float
    module that the quantized model replaces whole, keeping none of its children (a fused
    ``ConvReLU2d`` lowered to one kernel, when the reference is the fused float model), have one:
    that module, compared as a unit; so has a module in ``absorbed``: the layer that computes it."""
    float_modules = dict(float_model.named_modules())
    quant_modules = dict(quantized_model.named_modules())

    def replaced_whole(name: str) -> bool:
        parts = name.split(".")
        for ancestor in (".".join(parts[:i]) for i in range(1, len(parts))):
            if ancestor in quant_modules and not (
                    {n for n, _ in float_modules[ancestor].named_children()}
                    & {n for n, _ in quant_modules[ancestor].named_children()}):
                return True
        return False

    return [name for name, module in float_modules.items()
            if name and not any(module.children()) and name not in quant_modules and name not in absorbed
            and not replaced_whole(name)]
