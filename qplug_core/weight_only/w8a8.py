"""``qp.quantize_w8a8``: int8 weights and int8 activations for decoder LLMs, keeping ``generate()``.

W8A8 as LLM runtimes do it: SmoothQuant first (:mod:`~qplug_core.weight_only.smoothing`, folded
into the norms and the up projections, so it costs nothing at run time), then every linear of the
decoder becomes a :class:`~qplug_core.kernels.per_token.PerTokenDynamicLinear`: symmetric int8
weights per output channel, each token's activations on its own int8 grid, int32 accumulation
in oneDNN's int8 linear (VNNI, or AVX2 with 7-bit weights) or ``torch._int_mm``. Linears reading
one tensor (q/k/v) quantize it once.

It works by module swap on a copy of the model, like ``qp.quantize_weights``: a Hugging Face
``PreTrainedModel`` stays itself, with ``generate()``, its KV cache and its config.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from qplug_core.errors import CalibrationError, ConfigValidationError, warn_user
from qplug_core.flows.checks import check_float32, check_model, check_weight_values, refuse_quantized
from qplug_core.flows.dynamic import linear_from_conv1d
from qplug_core.flows.renamed_keywords import renamed_keywords
from qplug_core.flows.tags import W8A8
from qplug_core.ir.autocast_off import compute_in_float32
from qplug_core.kernels.layer_faults import name_layers
from qplug_core.kernels.per_token import (
    PerTokenDynamicLinear,
    SharedInput,
    best_gemm,
    per_token_quantize,
    symmetric_per_channel_int8,
    weight_qmax,
)
from qplug_core.kernels.static_int8 import StaticInt8Linear, static_activation_qparams
from qplug_core.registry.backends import Backend, resolve_backend
from qplug_core.weight_only import decode_step
from qplug_core.weight_only.api import (
    conv1d_class,
    nothing_quantized,
    output_head,
    own_copy,
    select_layers,
    skip_patterns,
    tied_output,
)
from qplug_core.weight_only.batches import calibration_batches, run_batch
from qplug_core.weight_only.smoothing import Smoothed, smooth

#: the attribute of a W8A8 model holding its :class:`W8A8Info` (``qp.save`` reads it)
W8A8_ATTRIBUTE = W8A8
LAYER_KIND = "per_token_linear"
STATIC_KIND = "static_int8_linear"
ACTIVATIONS = ("per_token", "static")


@dataclass
class W8A8Info:
    """What :func:`quantize_w8a8` did: the layers swapped (name -> kind), the inputs smoothed
    (where each scale was folded, with the strength), the int8 layers whose input could not be
    smoothed and why, the layers left float and why, the GEMM."""

    alpha: float | str | None
    gemm: str
    activations: str = "per_token"
    layers: dict[str, str] = field(default_factory=dict)
    smoothed: list[Smoothed] = field(default_factory=list)
    unsmoothed: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


@renamed_keywords(calibration="calibration_data")
def quantize_w8a8(model: nn.Module, calibration_data: Iterable[Any] | None = None, *,
                  alpha: float | str | None = "auto", activations: str = "per_token",
                  skip: str | Sequence[str] = (), quantize_head: bool = False,
                  backend: str | Backend | None = None) -> nn.Module:
    """A copy of ``model`` (eval mode) whose linears compute in int8 (weights per channel, activations
    per token).

    :param calibration_data: batches the model is called with to measure activations for SmoothQuant:
        token-id tensors (``model(batch)``), dicts (``model(**batch)``) or tuples
        (``model(*batch)``), a bare tensor being one batch; a few batches of the kind of text the
        model will see.
    :param alpha: SmoothQuant's migration strength: ``"auto"`` (searched per input, no smoothing
        among the candidates), a float in (0, 1) (0.5 is the paper's default), or ``None`` (no
        smoothing; then per-token activations need no calibration).
    :param activations: ``"per_token"`` (each token's range found at run time: the accurate
        choice for LLMs) or ``"static"`` (one range per linear input, measured on
        ``calibration_data`` after smoothing; values outside it are clamped).
    :param skip: module names or regular expressions (matched against the whole name) of linears
        to leave float.
    :param quantize_head: also quantize the output head (``lm_head``); it is left float by default,
        as the logits are the most sensitive output. A head tied to the input embedding stays
        float even then (an int8 copy would untie them), with a warning.
    :param backend: ``None`` (or a backend with kernels) runs the core's integer GEMM picked for
        this CPU; ``"reference"`` simulates the int8 arithmetic with float ops (the oracle).
    :return: the quantized copy, with a :class:`W8A8Info` as ``.qplug_w8a8``; a decoder's
        one-token decode steps run on one thread where that measures faster
        (:mod:`~qplug_core.weight_only.decode_step`, ``.qplug_decode_threads``).

    The model given is never modified.
    """
    check_model(model)
    check_float32(model)  # int8 linears with float32 scales: a bf16 model met them only at its first call
    check_weight_values(model)
    refuse_quantized(model)
    if alpha is not None and alpha != "auto" and not (isinstance(alpha, (int, float)) and 0 < alpha < 1):
        raise ConfigValidationError(f"alpha must be 'auto', a number in (0, 1) or None, got {alpha!r}",
                                    field="alpha", value=alpha)
    if activations not in ACTIVATIONS:
        raise ConfigValidationError(f"activations must be one of {ACTIVATIONS}, got {activations!r}",
                                    field="activations", value=activations)
    if activations == "static" and calibration_data is None:
        raise CalibrationError("activations='static' measures each linear's input range: pass "
                               "calibration_data=[batch, ...]")
    if alpha is not None and calibration_data is None:
        raise CalibrationError("qp.quantize_w8a8 needs calibration_data=[batch, ...] (a few token batches of the "
                               "kind of text the model will see) for SmoothQuant's scales, or alpha=None "
                               "to quantize without smoothing")
    calibration = calibration_batches(calibration_data, model)
    chosen = None if backend is None else resolve_backend(backend).require_available()
    if chosen is not None and not chosen.kernels and chosen.delegate is not None:
        raise ConfigValidationError(f"backend {chosen.name!r} compiles whole graphs, and qp.quantize_w8a8 swaps "
                                    "modules that run torch's own int8 kernels: leave backend out (the fastest "
                                    "per-token GEMM on this CPU is chosen) or use qp.quantize_weights, whose "
                                    f"kernels {chosen.name!r} may provide", field="backend", value=chosen.name)
    simulate = chosen is not None and not chosen.kernels
    gemm = "simulated" if simulate else best_gemm()
    patterns = skip_patterns(skip)
    qmodel = own_copy(model).eval()
    info = W8A8Info(alpha, gemm, activations)
    linears = _targets(qmodel, patterns, quantize_head, info)
    if not linears:
        raise nothing_quantized("nn.Linear", info.skipped)
    if alpha is not None:
        qmax = 127 if simulate else weight_qmax(gemm)
        info.smoothed = smooth(qmodel, linears, calibration, alpha,
                               lambda rows, layers, scale, fitting: output_error(
                                   rows, layers, scale, qmax, static=activations == "static", fitting=fitting),
                               info.unsmoothed)
    ranges = _input_ranges(qmodel, linears, calibration) if activations == "static" else {}
    shared = SharedInput()
    with torch.no_grad():
        for name, linear in linears.items():
            if activations == "static" and name in ranges:
                swapped: nn.Module = StaticInt8Linear.from_float_range(
                    linear, *ranges[name], simulate=simulate, gemm=None if simulate else gemm)
                info.layers[name] = STATIC_KIND
            else:  # static, but calibration never reached it: per-token needs no range
                swapped = PerTokenDynamicLinear.from_float(linear, simulate=simulate, shared=shared,
                                                           gemm=None if simulate else gemm)
                info.layers[name] = LAYER_KIND
            qmodel.set_submodule(name, swapped)
    setattr(qmodel, W8A8_ATTRIBUTE, info)
    compute_in_float32(qmodel)  # an int8 model computes in float32, autocast or not
    decode_step.install(qmodel.eval())  # the swapped layers too: the whole copy in eval mode
    name_layers(qmodel)
    return qmodel


def _targets(model: nn.Module, patterns: list[re.Pattern], quantize_head: bool,
             info: W8A8Info) -> dict[str, nn.Linear]:
    """The linears to quantize (transformers' ``Conv1D`` turned into ``nn.Linear`` in the copy)."""
    head = output_head(model)
    kinds: tuple[type, ...] = (nn.Linear,) + ((conv1d_class(),) if conv1d_class() else ())
    keep = "the output head stays float (quantize_head=True quantizes it)"
    chosen = select_layers(model, kinds, patterns, info.skipped,
                           lambda name: keep if name == head and not quantize_head else None)
    if quantize_head and head is not None and head == tied_output(model):
        warn_user(f"qplug: quantize_head=True left {head!r} float: its weight is tied to the input "
                  "embedding, and an int8 copy would untie them; to quantize it, untie the weights first "
                  "(tie_word_embeddings=False, with its own copy of the weight)")
    targets: dict[str, nn.Linear] = {}
    for name, module in chosen.items():
        if type(module) is not nn.Linear:
            module = linear_from_conv1d(module)
            model.set_submodule(name, module)
        targets[name] = module
    return targets


def _input_ranges(model: nn.Module, linears: dict[str, nn.Linear],
                  calibration: Iterable[Any]) -> dict[str, tuple[float, float]]:
    """(min, max) of every linear's input over the calibration batches (on the smoothed model)."""
    ranges: dict[str, tuple[float, float]] = {}

    def hook(name: str):
        def record(module: nn.Module, args: tuple) -> None:
            low, high = (float(v) for v in torch.aminmax(args[0].detach().float()))
            old = ranges.get(name, (low, high))
            ranges[name] = (min(old[0], low), max(old[1], high))
        return record

    handles = [linear.register_forward_pre_hook(hook(name)) for name, linear in linears.items()]
    try:
        with torch.no_grad():
            for index, batch in enumerate(calibration):
                run_batch(model, batch, index)
    finally:
        for handle in handles:
            handle.remove()
    return ranges


def output_error(rows: torch.Tensor, layers: list[nn.Linear], scale: torch.Tensor | None, qmax: int,
                 *, fitting: torch.Tensor, static: bool = False) -> float:
    """Relative squared error of the layers' int8 outputs on ``rows`` with smoothing ``scale``:
    per-token (or, ``static``, per-tensor, over the range of the rows ``fitting``)
    activations and per-channel weights of ``qmax``, as the swapped modules compute."""
    x = rows if scale is None else rows / scale
    if static:
        fit = fitting if scale is None else fitting / scale
        x_scale, zero_point = static_activation_qparams(float(fit.min()), float(fit.max()))
        xq = (torch.round(x / x_scale).add_(zero_point).clamp_(0, 255) - zero_point) * x_scale
    else:
        q, token_scale, token_zero_point = per_token_quantize(x)
        xq = (q.float() - token_zero_point) * token_scale
    num = den = 0.0
    for layer in layers:
        weight = layer.weight.detach().float()
        w_int8, w_scale = symmetric_per_channel_int8(weight if scale is None else weight * scale, qmax)
        want = rows @ weight.T
        got = xq @ (w_int8.float() * w_scale[:, None]).T
        num += float((got - want).square().sum())
        den += float(want.square().sum())
    return num / max(den, 1e-30)

