"""One small model per pattern config of a backend, and a check that the backend lowers it right.

Backend authors can prove every pattern they declare end to end::

    from qplug_core.testing import cases_for, check_pattern

    @pytest.mark.parametrize("case", cases_for("my_backend"), ids=lambda c: c.id)
    def test_pattern(case):
        if case.skip_reason:
            pytest.skip(case.skip_reason)
        result = check_pattern("my_backend", case)
        assert result.ok, result.explain()

:func:`cases_for` builds, for each :class:`~qplug_core.config.BackendPatternConfig`, a tiny model
whose body is exactly that pattern (module patterns instantiate the module type with small shapes;
functional, ``torch.*`` and method patterns are called inside the body's ``forward``; fusion
patterns are written as their op sequence). The body sits between int8 neighbours (a weighted op
before it and one after it) so that the connector rule quantizes it; the neighbour before it also
feeds the model's output, which keeps it from fusing with the pattern under test.

:func:`check_pattern` prepares the model for the backend, calibrates it, converts the *same*
observed model with :func:`~qplug_core.flows.steps.convert_to_reference_fx` and
:func:`~qplug_core.flows.steps.convert_fx`, and reports whether the pattern was matched, quantized and
lowered to the backend's kernel, and how far the two outputs are apart, in quantization steps of
each output (for float outputs of dynamic or weight-only ops: steps of an 8-bit grid over the
reference output's range).

Patterns that cannot occur in a traced model get a ``skip_reason``; recurrent modules run with the
backend's ``"dynamic"`` mapping, QAT module types under ``prepare_qat_fx``. Ops that the default
static mapping keeps float (norms, softmax) are switched on with the mapping's global qconfig.
"""

from __future__ import annotations

import copy
import operator
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from qplug_core.config import ObservationType, QConfigMapping
from qplug_core.errors import ConfigError, ConfigValidationError
from qplug_core.flows.report import QuantizationReport, report_names
from qplug_core.flows.tags import FROM_FUNCTIONAL, FUSIONS, region_tag
from qplug_core.kernels.reference import Dequantize
from qplug_core.nn import intrinsic as nni
from qplug_core.nn import qat
from qplug_core.patterns import format_pattern, to_simple_format
from qplug_core.registry.backends import Backend, get_backend

__all__ = ["OutputCheck", "PatternCase", "PatternResult", "case_id", "cases_for", "check_pattern"]

#: channels (conv) / features (linear) of every generated tensor
C = 4
#: default input shape by number of dimensions
SHAPES = {2: (2, 8), 3: (2, C, 8), 4: (2, C, 6, 6), 5: (2, C, 4, 4, 4)}
#: fraction of output elements that must agree within one quantization step
MIN_AGREEMENT = 0.99
#: averaging ops: their integer kernels round an average's ties unlike the float reference, so the
#: pattern's own output may be a step off where a tie falls (held to one step), and the int8 layer
#: after it can turn that step into two (measured: 1 of 24 outputs, fbgemm AvgPool1d, 7-bit weights)
_AVERAGING = {nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
              nn.AdaptiveAvgPool3d, F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, F.adaptive_avg_pool1d,
              F.adaptive_avg_pool2d, F.adaptive_avg_pool3d, torch.avg_pool1d, torch.adaptive_avg_pool1d}
#: steps allowed after an averaging op, in the neighbour that follows it
AFTER_AVERAGING_TOLERANCE_STEPS = 2.0
#: slack on one quantization step (float rounding of scales)
STEP_SLACK = 1.01
#: float outputs (dynamic and weight-only ops) have no quantization step of their own; they are
#: measured in steps of an 8-bit grid over the reference output's range, where one rounding
#: difference in a dynamically quantized input can move an element by slightly more than one step
#: (measured: at most 1.03 steps, GRU on qnnpack)
FLOAT_OUTPUT_TOLERANCE_STEPS = 1.5

_SKIP_METHOD_MISSING = ("torch.Tensor has no method {name!r}, so a traced model never contains this "
                        "call_method node (the config is inherited from torch.ao, where it is dead too)")
UNMATCHABLE: dict[Any, str] = {
    "shape": ("'shape' is a string pattern, which matches call_method nodes, but tracing records "
              "x.shape as call_function getattr(x, 'shape'): no traced model contains it (dead "
              "config, same in torch.ao)"),
    "hardsigmoid": _SKIP_METHOD_MISSING.format(name="hardsigmoid"),
    "hardsigmoid_": _SKIP_METHOD_MISSING.format(name="hardsigmoid_"),
    nn.Identity: ("removed before matching: nn.Identity computes nothing, so the flows drop it "
                  "instead of listing it as a float op (issue 19.15)"),
    nn.Dropout: ("removed before matching in eval mode (post-training quantization): eval-mode "
                 "dropout computes nothing (issue 19.15); in training mode it is matched"),
}
"""Patterns no traced model can contain, with the reason."""


# -- cases -----------------------------------------------------------------------------------------


@dataclass
class PatternCase:
    """One pattern config of a backend and a small model exercising exactly it."""

    pattern: Any  # complex format, the key of the backend's pattern config
    id: str
    make_model: Callable[[], nn.Module] | None
    example_inputs: tuple = ()
    calibration_data: list = field(default_factory=list)
    mode: str = "static"  # "static", "qat" or "dynamic"
    is_fusion: bool = False
    enable: tuple = ()  # ops the default mapping keeps float that this case quantizes
    expect_quantized: bool = True
    skip_reason: str | None = None
    #: allowed distance in quantization steps for the outputs downstream of the pattern
    tolerance_steps: float = 1.0


def case_id(pattern: Any) -> str:
    """``format_pattern`` (which marks QAT classes) plus ``nni.`` for fused float modules."""
    text = format_pattern(pattern)
    if isinstance(pattern, type) and pattern.__module__.startswith("qplug_core.nn.intrinsic"):
        return f"nni.{text}"
    return text


class _Body(nn.Module):
    """The op(s) under test: ``steps`` applied in order (submodules are named ``op0``, ``op1``...)."""

    def __init__(self, steps: list[Callable], modules: dict[str, nn.Module],
                 tensors: dict[str, torch.Tensor]):
        super().__init__()
        self.steps = steps
        for name, module in modules.items():
            self.add_module(name, module)
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor)

    def forward(self, x):
        for step in self.steps:
            x = step(self, x)
        return x


class _Sandwich(nn.Module):
    """``pre`` (int8 neighbour) -> body -> ``post`` (int8 neighbour); returns all three values."""

    def __init__(self, pre: nn.Module | None, body: nn.Module, post: nn.Module):
        super().__init__()
        self.pre = pre
        self.body = body
        self.post = post

    def forward(self, x):
        a = self.pre(x) if self.pre is not None else x
        y = self.body(a)
        if self.pre is None:
            return self.post(y), y
        return self.post(y), y, a


class _LastDim(nn.Module):
    """A Linear over the last dimension of any tensor (the int8 neighbour of sequence outputs)."""

    def __init__(self, features: int):
        super().__init__()
        self.linear = nn.Linear(features, 3)

    def forward(self, x):
        return self.linear(x)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _bn(cls: type, n: int = C) -> nn.Module:
    """A BatchNorm with non-trivial statistics and affine parameters (eval mode)."""
    bn = cls(n)
    g = _gen(7)
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(n, generator=g) * 0.1)
        bn.running_var.copy_(torch.rand(n, generator=g) + 0.5)
        bn.weight.copy_(torch.rand(n, generator=g) + 0.5)
        bn.bias.copy_(torch.randn(n, generator=g) * 0.1)
    return bn.eval()


_CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_CONVT = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
_BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
_FUNC_CONV = {F.conv1d: 1, F.conv2d: 2, F.conv3d: 3}
_FUNC_CONVT = {F.conv_transpose1d: 1, F.conv_transpose2d: 2, F.conv_transpose3d: 3}
_MODULE_DIMS: dict[type, int] = {
    **{_CONV[d]: d + 2 for d in _CONV}, **{_CONVT[d]: d + 2 for d in _CONVT},
    nn.BatchNorm1d: 2, nn.BatchNorm2d: 4, nn.BatchNorm3d: 5, nn.Linear: 2,
    nn.InstanceNorm1d: 3, nn.InstanceNorm2d: 4, nn.InstanceNorm3d: 5, nn.GroupNorm: 4,
    nn.AdaptiveAvgPool1d: 3, nn.AdaptiveAvgPool2d: 4, nn.AdaptiveAvgPool3d: 5,
    nn.AvgPool1d: 3, nn.AvgPool2d: 4, nn.AvgPool3d: 5,
    nn.MaxPool1d: 3, nn.MaxPool2d: 4, nn.MaxPool3d: 5,
    nn.Upsample: 4, nn.UpsamplingNearest2d: 4, nn.UpsamplingBilinear2d: 4, nn.Flatten: 4,
    # 3-d pads on 4-D inputs: torch cannot pad a conv3d's channels-last 5-D int8 output (check_padding)
    nn.ConstantPad1d: 3, nn.ConstantPad2d: 4, nn.ConstantPad3d: 4, nn.ZeroPad1d: 3, nn.ZeroPad2d: 4,
    nn.ZeroPad3d: 4,
}
_MODULE_FACTORIES: dict[type, Callable[[], nn.Module]] = {
    **{_CONV[d]: (lambda d=d: _CONV[d](C, C, 3, padding=1)) for d in _CONV},
    **{_CONVT[d]: (lambda d=d: _CONVT[d](C, C, 3, padding=1)) for d in _CONVT},
    nn.BatchNorm2d: lambda: _bn(nn.BatchNorm2d),
    nn.BatchNorm3d: lambda: _bn(nn.BatchNorm3d), nn.Linear: lambda: nn.Linear(8, 8),
    nn.InstanceNorm1d: lambda: nn.InstanceNorm1d(C), nn.InstanceNorm2d: lambda: nn.InstanceNorm2d(C),
    nn.InstanceNorm3d: lambda: nn.InstanceNorm3d(C), nn.GroupNorm: lambda: nn.GroupNorm(2, C),
    nn.AdaptiveAvgPool1d: lambda: nn.AdaptiveAvgPool1d(4),
    nn.AdaptiveAvgPool2d: lambda: nn.AdaptiveAvgPool2d(3),
    nn.AdaptiveAvgPool3d: lambda: nn.AdaptiveAvgPool3d(2),
    nn.AvgPool1d: lambda: nn.AvgPool1d(2), nn.AvgPool2d: lambda: nn.AvgPool2d(2),
    nn.AvgPool3d: lambda: nn.AvgPool3d(2), nn.MaxPool1d: lambda: nn.MaxPool1d(2),
    nn.MaxPool2d: lambda: nn.MaxPool2d(2), nn.MaxPool3d: lambda: nn.MaxPool3d(2),
    nn.ELU: nn.ELU, nn.LeakyReLU: lambda: nn.LeakyReLU(0.1), nn.Hardswish: nn.Hardswish,
    nn.SiLU: nn.SiLU,
    nn.Dropout: nn.Dropout, nn.PReLU: nn.PReLU, nn.Hardsigmoid: nn.Hardsigmoid,
    nn.Sigmoid: nn.Sigmoid, nn.Softmax: lambda: nn.Softmax(dim=1), nn.Tanh: nn.Tanh,
    nn.Hardtanh: lambda: nn.Hardtanh(-0.5, 0.5), nn.Identity: nn.Identity,
    nn.PixelShuffle: lambda: nn.PixelShuffle(2), nn.PixelUnshuffle: lambda: nn.PixelUnshuffle(2),
    nn.ReLU: nn.ReLU, nn.ReLU6: nn.ReLU6, nn.LayerNorm: lambda: nn.LayerNorm(6),
    nn.Embedding: lambda: nn.Embedding(10, 8), nn.EmbeddingBag: lambda: nn.EmbeddingBag(10, 8),
    nn.Upsample: lambda: nn.Upsample(scale_factor=2),
    nn.UpsamplingNearest2d: lambda: nn.UpsamplingNearest2d(scale_factor=2),
    nn.UpsamplingBilinear2d: lambda: nn.UpsamplingBilinear2d(scale_factor=2),
    nn.Flatten: lambda: nn.Flatten(2),
    nn.ConstantPad1d: lambda: nn.ConstantPad1d((2, 0), 0.0), nn.ConstantPad2d: lambda: nn.ConstantPad2d(1, 0.0),
    nn.ConstantPad3d: lambda: nn.ConstantPad3d(1, 0.0), nn.ZeroPad1d: lambda: nn.ZeroPad1d((2, 0)),
    nn.ZeroPad2d: lambda: nn.ZeroPad2d(1), nn.ZeroPad3d: lambda: nn.ZeroPad3d(1),
}
_RNN = {nn.LSTM: lambda: nn.LSTM(8, 8, batch_first=True), nn.GRU: lambda: nn.GRU(8, 8, batch_first=True),
        nn.LSTMCell: lambda: nn.LSTMCell(8, 8), nn.GRUCell: lambda: nn.GRUCell(8, 8),
        nn.RNNCell: lambda: nn.RNNCell(8, 8)}


def _other(b, x):
    """A second int8 operand for binary ops: a 1x1 conv (or linear) of the first."""
    return b.other(x)


_FUNCTION_STEPS: dict[Any, tuple[Callable, int | None]] = {
    # (step(body, x), dims or None for "any")
    **{op: ((lambda b, x, op=op: op(x, _other(b, x))), None)
       for op in (operator.add, torch.add, operator.mul, torch.mul)},
    torch.matmul: (lambda b, x: torch.matmul(x, _other(b, x)), 4),
    operator.matmul: (lambda b, x: x @ _other(b, x), 4),
    # (N, C, L) @ (N, L, C): the conv1d's channels-last output transposed is a contiguous (N, L, C)
    torch.bmm: (lambda b, x: torch.bmm(x, _other(b, x).transpose(1, 2)), 3),
    # (N, F) @ (F, N): a linear's output and the other linear's, transposed
    torch.mm: (lambda b, x: torch.mm(x, _other(b, x).t()), 2),
    torch.cat: (lambda b, x: torch.cat([x, _other(b, x)], 1), None),
    torch.stack: (lambda b, x: torch.stack([x, _other(b, x)], 1), 4),
    F.elu: (lambda b, x: F.elu(x), None), F.hardswish: (lambda b, x: F.hardswish(x), None),
    F.silu: (lambda b, x: F.silu(x), None),
    F.leaky_relu: (lambda b, x: F.leaky_relu(x, 0.1), None),
    F.dropout: (lambda b, x: F.dropout(x, 0.5, b.training), None),
    F.group_norm: (lambda b, x: F.group_norm(x, 2, b.gn_weight, b.gn_bias), 4),
    F.instance_norm: (lambda b, x: F.instance_norm(x), 4),
    F.layer_norm: (lambda b, x: F.layer_norm(x, (6,), b.ln_weight, b.ln_bias), 4),
    F.hardsigmoid: (lambda b, x: F.hardsigmoid(x), None),
    torch.sigmoid: (lambda b, x: torch.sigmoid(x), None), torch.tanh: (lambda b, x: torch.tanh(x), None),
    torch.relu: (lambda b, x: torch.relu(x), None), F.relu: (lambda b, x: F.relu(x), None),
    torch.adaptive_avg_pool1d: (lambda b, x: torch.adaptive_avg_pool1d(x, 4), 3),
    F.adaptive_avg_pool2d: (lambda b, x: F.adaptive_avg_pool2d(x, 3), 4),
    F.adaptive_avg_pool3d: (lambda b, x: F.adaptive_avg_pool3d(x, 2), 5),
    F.hardtanh: (lambda b, x: F.hardtanh(x, -0.5, 0.5), None),
    F.hardtanh_: (lambda b, x: F.hardtanh_(x, -0.5, 0.5), None),
    F.interpolate: (lambda b, x: F.interpolate(x, scale_factor=2.0, mode="nearest"), 4),
    F.max_pool1d: (lambda b, x: F.max_pool1d(x, 2), 3), F.max_pool2d: (lambda b, x: F.max_pool2d(x, 2), 4),
    F.max_pool3d: (lambda b, x: F.max_pool3d(x, 2), 5),
    F.pixel_shuffle: (lambda b, x: F.pixel_shuffle(x, 2), 4),
    F.pixel_unshuffle: (lambda b, x: F.pixel_unshuffle(x, 2), 4),
    F.relu6: (lambda b, x: F.relu6(x), None),
    torch.avg_pool1d: (lambda b, x: torch.avg_pool1d(x, 2), 3),
    F.avg_pool2d: (lambda b, x: F.avg_pool2d(x, 2), 4), F.avg_pool3d: (lambda b, x: F.avg_pool3d(x, 2), 5),
    torch.clamp: (lambda b, x: torch.clamp(x, -0.5, 0.5), None),
    torch.clip: (lambda b, x: torch.clip(x, -0.5, 0.5), None),
    torch.flatten: (lambda b, x: torch.flatten(x, 1), 4),
    torch.mean: (lambda b, x: torch.mean(x, (2, 3), keepdim=True), 4),
    torch.narrow: (lambda b, x: torch.narrow(x, 1, 0, 2), None),
    torch.repeat_interleave: (lambda b, x: torch.repeat_interleave(x, 2, dim=1), None),
    torch.transpose: (lambda b, x: torch.transpose(x, 2, 3), 4),
    torch.squeeze: (lambda b, x: torch.squeeze(x, 2), "squeezable"),
    torch.unsqueeze: (lambda b, x: torch.unsqueeze(x, 2), 3),
    operator.floordiv: (lambda b, x: x // 2, None),
    F.pad: (lambda b, x: F.pad(x, (2, 0)), None),
    operator.getitem: (lambda b, x: x[..., :-1], None),
    torch.chunk: (lambda b, x: torch.chunk(x, 2, 1)[1], None),  # a piece read by index (a C2f block)
    torch.split: (lambda b, x: torch.split(x, 2, 1)[0], None),
    **{f: ((lambda b, x, f=f: f(x, b.conv_weight, b.conv_bias, padding=1)), d + 2)
       for f, d in {**_FUNC_CONV, **_FUNC_CONVT}.items()},
    F.linear: (lambda b, x: F.linear(x, b.linear_weight, b.linear_bias), 2),
}
_METHOD_STEPS: dict[str, tuple[Callable, int | str | None]] = {
    "contiguous": (lambda b, x: x.contiguous(), None),
    "clamp": (lambda b, x: x.clamp(-0.5, 0.5), None), "clip": (lambda b, x: x.clip(-0.5, 0.5), None),
    "detach": (lambda b, x: x.detach(), None), "detach_": (lambda b, x: x.detach_(), None),
    "mean": (lambda b, x: x.mean((2, 3), keepdim=True), 4),
    "permute": (lambda b, x: x.permute(0, 1, 3, 2), 4),
    "repeat": (lambda b, x: x.repeat(1, 1, 2, 1), 4),
    "repeat_interleave": (lambda b, x: x.repeat_interleave(2, dim=2), 4),
    "reshape": (lambda b, x: x.reshape(2, C, -1), 4),
    "resize_": (lambda b, x: x.resize_(2, C, 36), 4),
    "relu": (lambda b, x: x.relu(), None), "relu_": (lambda b, x: x.relu_(), None),
    "squeeze": (lambda b, x: x.squeeze(2), "squeezable"),
    "squeeze_": (lambda b, x: x.squeeze_(2), "squeezable"),
    "transpose": (lambda b, x: x.transpose(2, 3), 4),
    "unsqueeze": (lambda b, x: x.unsqueeze(2), 3), "unsqueeze_": (lambda b, x: x.unsqueeze_(2), 3),
    "view": (lambda b, x: x.view(2, C, -1), 4),
    "flatten": (lambda b, x: x.flatten(2), 4),
    "sigmoid": (lambda b, x: x.sigmoid(), None), "sigmoid_": (lambda b, x: x.sigmoid_(), None),
    "tanh": (lambda b, x: x.tanh(), None), "tanh_": (lambda b, x: x.tanh_(), None),
    "size": (lambda b, x: x.view(x.size(0), x.size(1), -1), 4),
    "chunk": (lambda b, x: x.chunk(2, 1)[1], None), "split": (lambda b, x: x.split(2, 1)[0], None),
    "matmul": (lambda b, x: x.matmul(_other(b, x)), 4),
    "bmm": (lambda b, x: x.bmm(_other(b, x).transpose(1, 2)), 3),
    "mm": (lambda b, x: x.mm(_other(b, x).t()), 2),
}
#: ops whose step reads a second int8 operand (``b.other``)
_TWO_OPERANDS = (operator.add, torch.add, operator.mul, torch.mul, torch.matmul, operator.matmul, "matmul",
                 torch.bmm, "bmm", torch.mm, "mm", torch.cat, torch.stack)


def _module_dims(op: type) -> int | None:
    if op in _MODULE_DIMS:
        return _MODULE_DIMS[op]
    float_module = getattr(op, "FLOAT_MODULE", None)
    if float_module is not None:
        return _module_dims(float_module)
    if isinstance(op, type) and issubclass(op, nni.FusedModule):
        return _module_dims(op.CHILD_TYPES[0])
    if op in _RNN or op in (nn.Embedding, nn.EmbeddingBag):
        return 0  # not an image: handled by the case builder
    return None


def _leaf_dims(op: Any) -> int | str | None:
    if isinstance(op, type):
        return _module_dims(op)
    table = _METHOD_STEPS if isinstance(op, str) else _FUNCTION_STEPS
    entry = table.get(op)
    return entry[1] if entry else None


def _make_module(op: type, qconfigs: dict[str, Any]) -> nn.Module:
    """A small instance of module type ``op`` (fused and QAT types built from their float parts)."""
    if op is nn.BatchNorm1d:  # after a linear (8 features) or a conv1d (C channels)
        return _bn(nn.BatchNorm1d, qconfigs.get("bn1d_features", C))
    if op in _MODULE_FACTORIES:
        return _MODULE_FACTORIES[op]()
    if op in _RNN:
        return _RNN[op]()
    float_module = getattr(op, "FLOAT_MODULE", None)
    if float_module is not None:  # QAT module: from its float (or fused float) module
        key = "embedding" if float_module in (nn.Embedding, nn.EmbeddingBag) else "global"
        return op.from_float(_make_module(float_module, qconfigs), qconfigs[key]).train()
    if isinstance(op, type) and issubclass(op, nni.FusedModule):
        return op(*(_make_module(child, qconfigs) for child in op.CHILD_TYPES)).eval()
    raise ConfigValidationError(
        f"cannot build a small {getattr(op, '__name__', op)} for its pattern case: the testing kit "
        "builds torch.nn layers, qplug's QAT modules and fused modules that subclass "
        "qplug_core.plugin_api.FusedModule with CHILD_TYPES naming their children's types",
        field="pattern", value=op)


def _step_for(op: Any, index: int, modules: dict, tensors: dict, qconfigs: dict) -> Callable:
    if isinstance(op, type):
        name = f"op{index}"
        modules[name] = _make_module(op, qconfigs)
        if op in (nn.LSTM, nn.GRU, nn.LSTMCell):
            return lambda b, x, name=name: getattr(b, name)(x)[0]
        return lambda b, x, name=name: getattr(b, name)(x)
    step = (_METHOD_STEPS if isinstance(op, str) else _FUNCTION_STEPS)[op][0]
    g = _gen(11 + index)
    if op in _FUNC_CONV or op in _FUNC_CONVT:
        d = {**_FUNC_CONV, **_FUNC_CONVT}[op]
        tensors["conv_weight"] = torch.randn(C, C, *(3,) * d, generator=g) * 0.2
        tensors["conv_bias"] = torch.randn(C, generator=g) * 0.1
    elif op is F.linear:
        tensors["linear_weight"] = torch.randn(8, 8, generator=g) * 0.3
        tensors["linear_bias"] = torch.randn(8, generator=g) * 0.1
    elif op is F.group_norm:
        tensors["gn_weight"] = torch.rand(C, generator=g) + 0.5
        tensors["gn_bias"] = torch.randn(C, generator=g) * 0.1
    elif op is F.layer_norm:
        tensors["ln_weight"] = torch.rand(6, generator=g) + 0.5
        tensors["ln_bias"] = torch.randn(6, generator=g) * 0.1
    return step


def _neighbour(dims: int) -> Callable[[int], nn.Module]:
    if dims == 2:
        return lambda channels: nn.Linear(channels, 3)
    return lambda channels: _CONV[dims - 2](channels, 3, 1)


def _pre_for(dims: int) -> nn.Module:
    return nn.Linear(8, 8) if dims == 2 else _CONV[dims - 2](C, C, 3, padding=1)


def _input_shape(dims: int | str) -> tuple[int, ...]:
    if dims == "squeezable":
        return (2, C, 1, 6)
    return SHAPES[dims]


def _chain(pattern: Any) -> list[Any]:
    simple = to_simple_format(pattern)
    return list(simple) if isinstance(simple, tuple) else [simple]


def _build(pattern: Any, qconfigs: dict[str, Any]) -> tuple[Callable[[], nn.Module], tuple, list, str]:
    """(model factory, example inputs, calibration batches, mode) for one pattern."""
    chain = _chain(pattern)
    first = chain[0]
    dims_list = [d for d in (_leaf_dims(op) for op in chain) if d is not None]
    dims = dims_list[0] if dims_list else 4
    mode = "static"
    if any(isinstance(op, type) and op.__module__.startswith("qplug_core.nn.qat") for op in chain):
        mode = "qat"
    if first in _RNN:
        mode = "dynamic"
    if isinstance(first, type) and issubclass(first, nni.FusedModule) and any(
            t in _BN.values() for t in first.CHILD_TYPES[1:]):
        mode = "qat"  # float ConvBn*/LinearBn1d only exist between QAT fusion and the QAT swap

    linear = any(op in (nn.Linear, F.linear) or _module_dims(op) == 2 for op in chain
                 if op is not nn.BatchNorm1d)
    qconfigs = {**qconfigs, "bn1d_features": 8 if linear else C}

    def make() -> nn.Module:
        torch.manual_seed(0)
        modules: dict[str, nn.Module] = {}
        tensors: dict[str, torch.Tensor] = {}
        steps = [_step_for(op, i, modules, tensors, qconfigs) for i, op in enumerate(chain)]
        if dims == 0:  # sequences: embeddings (indices in) and recurrent modules
            pre = None if first in (nn.Embedding, nn.EmbeddingBag) or getattr(
                first, "FLOAT_MODULE", None) in (nn.Embedding, nn.EmbeddingBag) else nn.Linear(8, 8)
            body = _Body(steps, modules, tensors)
            return _Sandwich(pre, body, _LastDim(8))
        if dims == "squeezable":
            pre = _CONV[2](C, C, 3, padding=1)
        else:
            pre = _pre_for(dims)
        if any(op in _TWO_OPERANDS for op in chain):
            modules["other"] = nn.Linear(8, 8) if dims == 2 else _CONV[dims - 2](C, C, 1)
        body = _Body(steps, modules, tensors)
        with torch.no_grad():
            y = body.eval()(pre.eval()(torch.zeros(_input_shape(dims))))
        post = _neighbour(y.dim())(y.shape[1])
        return _Sandwich(pre, body, post).eval()

    g = _gen(1)
    if dims == 0:
        if first in _RNN:
            shape = (2, 5, 8) if first in (nn.LSTM, nn.GRU) else (2, 8)
            batches = [(torch.randn(shape, generator=g),) for _ in range(2)]
        else:
            batches = [(torch.randint(0, 10, (2, 5), generator=g),) for _ in range(2)]
    else:
        batches = [(torch.randn(_input_shape(dims), generator=g),) for _ in range(2)]
    return make, batches[0], batches, mode


def _qconfigs(backend: Backend) -> dict[str, Any]:
    """The QAT qconfigs the QAT modules of the cases are built with; none for a backend without a
    default 'qat' mapping (an inference-only runtime): its QAT cases are skipped, saying so."""
    try:
        mapping = backend.default_qconfig_mapping("qat")
    except ConfigError:
        return {}
    return {"global": mapping.global_qconfig,
            "embedding": mapping.object_type_qconfigs.get(nn.Embedding)}


def _has_default(backend: Backend, mode: str) -> bool:
    try:
        backend.default_qconfig_mapping(mode)
    except ConfigError:
        return False
    return True


def cases_for(backend: str | Backend) -> list[PatternCase]:
    """One :class:`PatternCase` per pattern config of ``backend`` (ids are unique and readable).
    A pattern the backend gives no dtype config (a family its DTypeConfigSet leaves out), and a
    QAT or dynamic case of a backend without a default mapping for that mode, is skipped saying so."""
    chosen = get_backend(backend)
    qconfigs = _qconfigs(chosen)
    dynamic_default = _has_default(chosen, "dynamic")
    cases: list[PatternCase] = []
    seen: dict[str, int] = {}
    for config in chosen.config.configs:
        pattern = config.pattern_complex_format
        ident = case_id(pattern)
        seen[ident] = seen.get(ident, 0) + 1
        if seen[ident] > 1:
            ident = f"{ident}#{seen[ident]}"
        if pattern in UNMATCHABLE:
            cases.append(PatternCase(pattern, ident, None, skip_reason=UNMATCHABLE[pattern]))
            continue
        if not config.dtype_configs:
            cases.append(PatternCase(pattern, ident, None, skip_reason=(
                f"backend {chosen.name!r} gives this pattern no dtype config: it claims no int8 form of it")))
            continue
        no_qat = f"backend {chosen.name!r} has no default 'qat' qconfig mapping to build this QAT case with"
        try:
            make, example, batches, mode = _build(pattern, qconfigs)
        except (KeyError, ValueError) as error:
            why = no_qat if not qconfigs and isinstance(error, KeyError) else \
                f"no small model known for this pattern ({error!r})"
            cases.append(PatternCase(pattern, ident, None, skip_reason=why))
            continue
        if mode == "qat" and not qconfigs:
            cases.append(PatternCase(pattern, ident, None, skip_reason=no_qat))
            continue
        if mode == "dynamic" and not dynamic_default:
            cases.append(PatternCase(pattern, ident, None, skip_reason=(
                f"backend {chosen.name!r} has no default 'dynamic' qconfig mapping to run this dynamic case with")))
            continue
        chain = _chain(pattern)
        case = PatternCase(
            pattern, ident, make, example, batches, mode=mode,
            is_fusion=config.fuser_method is not None,
            expect_quantized=config.observation_type != ObservationType.INPUT_OUTPUT_NOT_OBSERVED)
        case.enable = tuple(op for op in chain if _kept_float(chosen, mode, op))
        cases.append(case)
    return cases


def _kept_float(backend: Backend, mode: str, op: Any) -> bool:
    if mode == "dynamic":
        return False
    mapping = backend.default_qconfig_mapping(mode)
    return op in mapping.object_type_qconfigs and mapping.object_type_qconfigs[op] is None


# -- checking --------------------------------------------------------------------------------------


@dataclass
class OutputCheck:
    """How one model output of the lowered model compares with the reference model's."""

    index: int
    step: float  # the output's quantization step (scale), or range/255 for float outputs
    quantized: bool
    max_steps: float
    agreement: float  # fraction of elements within the tolerance
    tolerance_steps: float = 1.0

    @property
    def ok(self) -> bool:
        return self.agreement >= MIN_AGREEMENT


@dataclass
class PatternResult:
    """What :func:`check_pattern` found for one case."""

    case_id: str
    backend: str
    mode: str
    matched: bool = False
    fused_into: str | None = None  # fused module type, for fusion patterns
    region_pattern: str | None = None  # the pattern prepare quantized (after fusion)
    anchors: list[str] = field(default_factory=list)
    quantized: bool = False
    not_quantized_reason: str = ""
    expect_kernel: bool = False
    kernels: dict[str, str] = field(default_factory=dict)  # anchor -> kernel op
    reference: dict[str, str] = field(default_factory=dict)  # anchor -> why reference form
    outputs: list[OutputCheck] = field(default_factory=list)
    sqnr_db: float | None = None  # lowered vs float, at the body's output
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def lowered(self) -> bool:
        return bool(self.anchors) and all(a in self.kernels for a in self.anchors)

    def explain(self) -> str:
        lines = [f"{self.case_id} on {self.backend} ({self.mode}):", *(f"  - {p}" for p in self.problems)]
        lines.append(f"  region {self.region_pattern!r} anchors {self.anchors} kernels {self.kernels} "
                     f"reference {self.reference}")
        lines += [f"  output {o.index}: {o.agreement:.2%} within {o.tolerance_steps:g} step(s) "
                  f"(max {o.max_steps:.2f} steps)"
                  for o in self.outputs]
        return "\n".join(lines)


def case_mapping(backend: Backend, case: PatternCase) -> QConfigMapping:
    mapping = backend.default_qconfig_mapping(case.mode)
    if case.mode == "qat":  # QAT embeddings in the model get the embedding qconfig, not the global one
        for qat_embedding, embedding in ((qat.Embedding, nn.Embedding),
                                         (qat.EmbeddingBag, nn.EmbeddingBag)):
            mapping.set_object_type(qat_embedding, mapping.object_type_qconfigs.get(embedding))
    for op in case.enable:
        mapping.set_object_type(op, mapping.global_qconfig)
    return mapping


def _regions(observed: fx.GraphModule, case: PatternCase, result: PatternResult):
    """Tags of the region(s) exercising ``case.pattern`` (after fusion, the fused module's)."""
    if case.is_fusion:
        name = format_pattern(case.pattern)
        records = [f for f in observed.meta.get(FUSIONS, []) if f.pattern == name]
        if not records:
            return []
        result.fused_into = records[0].fused_type
        roots = {f.module_name for f in records}
        nodes = [n for n in observed.graph.nodes if n.op == "call_module" and n.target in roots]
    else:
        nodes = [n for n in observed.graph.nodes
                 if (t := region_tag(n)) is not None and t.is_anchor
                 and (t.pattern == case.pattern or _made_from_root_of(n, case.pattern))]
    return [(n, region_tag(n)) for n in nodes if region_tag(n) is not None]


def _made_from_root_of(node: fx.Node, pattern: Any) -> bool:
    """A functional linear/conv on a constant weight becomes a module before matching (the module's
    kernel serves it); its region then stands for the functional pattern, whatever it fused with."""
    root = pattern[-1] if isinstance(pattern, tuple) else pattern
    made_from = node.meta.get(FROM_FUNCTIONAL)
    return made_from is not None and made_from is root


def _output_scales(reference: fx.GraphModule) -> list[float | None]:
    out = next(n for n in reference.graph.nodes if n.op == "output")
    values = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    scales = []
    for node in values:
        module = reference.get_submodule(node.target) if (
            isinstance(node, fx.Node) and node.op == "call_module") else None
        if isinstance(module, Dequantize) and module.qparams.scale.numel() == 1:
            scales.append(float(module.qparams.scale))
        else:
            scales.append(None)
    return scales


def as_tuple(value: Any) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def _sqnr(reference: torch.Tensor, test: torch.Tensor) -> float:
    noise = (reference.double() - test.double()).pow(2).mean()
    signal = reference.double().pow(2).mean()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(signal / noise))


def _not_delegated(chosen: Backend, result: PatternResult, report: QuantizationReport,
                   reference: fx.GraphModule) -> list[str]:
    """For a backend with a delegate: the pattern's int8 anchors its operator support takes (in
    the reference form) that did not end in a compiled partition. A compiler that always failed,
    or always broke the contract, left every case in reference form, and the suite passed."""
    delegate = getattr(chosen, "delegate", None)
    if delegate is None or not result.quantized:
        return []
    name, submodules = report_names(reference.graph), dict(reference.named_modules())
    taken = {name(n) for n in reference.graph.nodes if n.op in ("call_module", "call_function", "call_method")
             and delegate.operator_support.is_node_supported(submodules, n)}
    stuck = {a: report.reference.get(a, "?") for a in result.anchors if a in taken and a not in report.kernels}
    if not stuck:
        return []
    return [f"the delegate of {chosen.name!r} takes {list(stuck)} ({result.region_pattern}) but they did not "
            f"run in a compiled partition: {list(stuck.values())}"]


def check_pattern(backend: str | Backend, case: PatternCase) -> PatternResult:
    """Quantize ``case``'s model with ``backend`` and with the reference form; compare them."""
    from qplug_core.flows import steps as flows  # the flows import this package's siblings: at call time

    chosen = get_backend(backend)
    result = PatternResult(case.id, chosen.name, case.mode)
    if case.make_model is None:
        result.problems.append(f"case cannot run: {case.skip_reason}")
        return result
    model = case.make_model()
    mapping = case_mapping(chosen, case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "stays float" warnings are checked below
        prepare = flows.prepare_qat_fx if case.mode == "qat" else flows.prepare_fx
        observed = prepare(model, mapping, case.example_inputs, backend=chosen)
    flows.calibrate(observed, case.calibration_data, progress=False)
    if case.mode == "qat":
        observed.eval()
    reference = flows.convert_to_reference_fx(observed)
    lowered = flows.convert_fx(observed, backend=chosen)
    report = flows.quantization_report(lowered)

    regions = _regions(observed, case, result)
    result.matched = bool(regions)
    if not regions:
        result.problems.append("the pattern was not matched in the generated model")
    else:
        tag = regions[0][1]
        result.region_pattern = tag.pattern_name
        report_key = report_names(observed.graph)
        result.anchors = [report_key(n) for n, t in regions if t.quantized]
        result.quantized = bool(result.anchors)
        if not result.quantized:
            result.not_quantized_reason = tag.reason
        if case.expect_quantized and not result.quantized:
            result.problems.append(f"the pattern's region was not quantized: {tag.reason}")
        result.expect_kernel = tag.pattern in chosen.kernels
    result.kernels = {a: report.kernels[a] for a in result.anchors if a in report.kernels}
    result.reference = {a: report.reference[a] for a in result.anchors if a in report.reference}
    if result.expect_kernel and result.quantized and not result.lowered:
        missing = [a for a in result.anchors if a not in report.kernels]
        result.problems.append(f"the backend has a kernel for {result.region_pattern} but "
                               f"{missing} stayed in reference form: "
                               f"{[report.reference.get(a, '?') for a in missing]}")
    result.problems += _not_delegated(chosen, result, report, reference)

    with torch.no_grad():
        float_out = as_tuple(copy.deepcopy(model).eval()(*case.example_inputs))
        ref_out = as_tuple(reference(*case.example_inputs))
        low_out = as_tuple(lowered(*case.example_inputs))
    scales = _output_scales(reference)
    for index, (ref, low) in enumerate(zip(ref_out, low_out)):
        if ref.shape != low.shape:
            result.problems.append(f"output {index}: shape {tuple(low.shape)} != reference "
                                   f"{tuple(ref.shape)}")
            continue
        scale = scales[index] if index < len(scales) else None
        step = scale if scale is not None else max(float(ref.max() - ref.min()) / 255.0, 1e-8)
        # output 2 is the neighbour before the pattern: it never depends on the pattern
        tolerance = 1.0 if index == 2 else case.tolerance_steps
        if index == 0 and any(op in _AVERAGING for op in _chain(case.pattern)):
            tolerance = max(tolerance, AFTER_AVERAGING_TOLERANCE_STEPS)
        if scale is None:
            tolerance = max(tolerance, FLOAT_OUTPUT_TOLERANCE_STEPS)
        diff = (low.float() - ref.float()).abs()
        check = OutputCheck(index, step, scale is not None, float(diff.max()) / step,
                            float((diff <= tolerance * step * STEP_SLACK).float().mean()), tolerance)
        result.outputs.append(check)
        if not check.ok:
            result.problems.append(f"output {index}: only {check.agreement:.2%} of elements within "
                                   f"{tolerance:g} step(s) ({step:.3g}) of the reference (max "
                                   f"{check.max_steps:.1f} steps)")
    if len(float_out) > 1:
        result.sqnr_db = _sqnr(float_out[1], low_out[1])
    return result
