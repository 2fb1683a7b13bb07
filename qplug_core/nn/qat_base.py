"""What every QAT module shares: the weight fake-quant, from_float/to_float, and BN-in-the-loop.

A QAT module is its float module (it subclasses ``nn.Conv2d``, ``nn.Linear``, ...) whose forward
runs on ``weight_fake_quant(weight)``, so training sees int8 rounding while the float weights stay
ordinary parameters. ``from_float`` shares the float module's parameters (no copy); ``to_float``
returns a fresh float module with the trained values (and BatchNorm folded in).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrize import (
    is_parametrized,
    transfer_parametrizations_and_params,
    type_before_parametrizations,
)

from qplug_core.errors import ConfigValidationError
from qplug_core.ir.tracing import run_eagerly
from qplug_core.nn.folding import fold_bn_weights
from qplug_core.nn.intrinsic import FusedModule

__all__ = [
    "QATModule", "QATWithBn", "build_weight_fake_quant", "freeze_bn_stats", "resolve_qconfig",
    "check_float_module", "share_parameter", "update_bn_stats",
]


def resolve_qconfig(cls: type, mod: nn.Module | None, qconfig: Any) -> Any:
    """``qconfig`` if given, else ``mod.qconfig``; a QAT module without one cannot fake-quantize."""
    qconfig = qconfig if qconfig is not None else getattr(mod, "qconfig", None)
    if qconfig is None or getattr(qconfig, "weight", None) is None:
        raise ConfigValidationError(
            f"{cls.__name__} needs a qconfig with a weight fake-quant factory (qconfig.weight); "
            "pass qconfig=... or set module.qconfig before prepare_qat", field="qconfig", value=qconfig)
    return qconfig


def check_float_module(cls: type, mod: nn.Module) -> None:
    """``cls.from_float`` accepts exactly ``cls.FLOAT_MODULE`` (parametrized modules by their original type)."""
    got = type_before_parametrizations(mod)
    if got is not cls.FLOAT_MODULE:
        raise ConfigValidationError(
            f"{cls.__module__}.{cls.__name__}.from_float takes a {cls.FLOAT_MODULE.__name__}, "
            f"got {got.__name__}", field="mod", value=got)


def build_weight_fake_quant(qconfig: Any, like: torch.Tensor, where: str = "weight") -> nn.Module:
    """``qconfig.weight()`` placed on the weight's device; one with per-channel parameters
    (``LearnableFakeQuantize.fit_channels``) sized to the weight's channels."""
    fake_quant = qconfig.weight()
    if getattr(fake_quant, "is_per_channel", False) and hasattr(fake_quant, "fit_channels"):
        fake_quant.fit_channels(like.shape[fake_quant.ch_axis], where)
    return fake_quant.to(like.device) if isinstance(fake_quant, nn.Module) else fake_quant


def share_parameter(src: nn.Module, dst: nn.Module, name: str) -> None:
    """Make ``dst.name`` the very parameter of ``src`` (with its parametrizations, if any)."""
    if is_parametrized(src, name):
        # registering on dst runs each parametrization once on dst's fresh weight: spectral_norm's
        # power iteration then moved its vectors (the QAT weight was off by up to 74%); put them back
        state = {k: b.clone() for k, b in src.parametrizations[name].named_buffers()}
        transfer_parametrizations_and_params(src, dst, name)
        with torch.no_grad():
            for key, buffer in dst.parametrizations[name].named_buffers():
                buffer.copy_(state[key])
    else:
        setattr(dst, name, getattr(src, name))


class QATModule:
    """Mixin for weighted QAT modules; concrete classes also inherit the float module class.

    Subclasses set ``FLOAT_MODULE`` (the exact type ``from_float`` accepts), ``FLOAT_ROOT`` (the
    plain weighted float class), ``FUSED_FLOAT`` (the fused float class ``to_float`` returns when
    ``WITH_RELU``), and implement ``_root_args`` and ``_apply_weight``.
    """

    FLOAT_MODULE: ClassVar[type[nn.Module]]
    FLOAT_ROOT: ClassVar[type[nn.Module]]
    FUSED_FLOAT: ClassVar[type[nn.Module] | None] = None
    WITH_RELU: ClassVar[bool] = False

    weight: torch.Tensor
    bias: torch.Tensor | None
    training: bool

    def _init_fake_quant(self, qconfig: Any) -> None:
        self.qconfig = resolve_qconfig(type(self), None, qconfig)
        self.weight_fake_quant = build_weight_fake_quant(self.qconfig, self.weight, type(self).__name__)

    @staticmethod
    def _root_args(root: nn.Module) -> dict[str, Any]:
        raise NotImplementedError

    def _apply_weight(self, x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def _pre_activation(self, x: torch.Tensor) -> torch.Tensor:
        return self._apply_weight(x, self.weight_fake_quant(self.weight), self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._pre_activation(x)
        return F.relu(y) if self.WITH_RELU else y

    @classmethod
    def from_float(cls, mod: nn.Module, qconfig: Any = None) -> Any:
        """The QAT module for a float (or fused float) module, sharing its parameters."""
        check_float_module(cls, mod)
        qconfig = resolve_qconfig(cls, mod, qconfig)
        root = mod[0] if isinstance(mod, FusedModule) else mod
        qat = cls(**cls._root_args(root), qconfig=qconfig,
                  device=root.weight.device, dtype=root.weight.dtype)
        share_parameter(root, qat, "weight")
        share_parameter(root, qat, "bias")
        qat._adopt_children(mod)
        qat.train(mod.training)
        return qat

    def _adopt_children(self, mod: nn.Module) -> None:
        """Hook for modules that keep more float state than the root (BatchNorm)."""

    def _float_weight_bias(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.weight.detach(), None if self.bias is None else self.bias.detach()

    def to_float(self) -> nn.Module:
        """A float module computing what this module computes without fake quant (BN folded)."""
        weight, bias = self._float_weight_bias()
        root = self.FLOAT_ROOT(**self._root_args(self) | {"bias": bias is not None},
                               device=weight.device, dtype=weight.dtype)
        root.weight = nn.Parameter(weight.clone())
        if bias is not None:
            root.bias = nn.Parameter(bias.clone())
        result = self.FUSED_FLOAT(root, nn.ReLU()) if self.WITH_RELU else root
        result.train(self.training)
        return result


class QATWithBn(QATModule):
    """QAT weighted op followed by a real BatchNorm (ConvBn*, LinearBn1d), as in torch.ao.

    Forward (Krishnamoorthi 2018, sec. 3.2): scale the weight by ``s = gamma / sqrt(running_var +
    eps)`` so that the fake quant sees the weight the int8 model will use after folding, run the
    op without bias on ``fq(W * s)``, divide by ``s``, add the bias, then apply the BatchNorm in its
    current mode. With fake quant disabled this equals ``bn(op(x))`` exactly (up to rounding), and
    BN's running statistics update as usual. ``bn.weight == 0`` would divide by zero, as upstream.

    Whether BN is frozen is the buffer ``bn_frozen`` (read and set as ``freeze_bn``, torch.ao's
    attribute), so a ``state_dict`` checkpoint restores it with the observer flags; a checkpoint
    saved before it existed loads as not frozen.
    """

    BN_CLASS: ClassVar[type[nn.Module]]
    bn: nn.Module
    bn_frozen: torch.Tensor

    def _init_bn(self, out_channels: int, eps: float, momentum: float | None, freeze_bn: bool,
                 device: Any, dtype: Any) -> None:
        self.bn = self.BN_CLASS(out_channels, eps, momentum, affine=True, track_running_stats=True,
                                device=device, dtype=dtype)
        self.register_buffer("bn_frozen", torch.tensor([0], dtype=torch.uint8, device=device))
        self.freeze_bn = freeze_bn or not self.training
        self.bn.train(not self.freeze_bn)

    @property
    def freeze_bn(self) -> bool:
        return bool(self.bn_frozen[0])

    @freeze_bn.setter
    def freeze_bn(self, frozen: bool) -> None:
        self.bn_frozen[0] = 1 if frozen else 0

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # older checkpoints have no flag: not frozen; BN's mode follows what was loaded
        state_dict.setdefault(prefix + "bn_frozen", torch.zeros_like(self.bn_frozen))
        super()._load_from_state_dict(state_dict, prefix, *args)  # type: ignore[misc]
        self.bn.train(self.training and not self.freeze_bn)

    def _adopt_children(self, mod: nn.Module) -> None:
        bn = mod[1]
        if not bn.affine or not bn.track_running_stats:
            raise ConfigValidationError(
                f"{type(self).__name__} needs a BatchNorm with affine=True and "
                "track_running_stats=True", field="bn", value=bn)
        self.bn = bn

    def freeze_bn_stats(self) -> QATWithBn:
        """Stop updating BN statistics: BN normalises with its running stats from now on."""
        self.freeze_bn = True
        self.bn.train(False)
        return self

    def update_bn_stats(self) -> QATWithBn:
        """Resume BN statistics updates (they happen while the module is in training mode)."""
        self.freeze_bn = False
        self.bn.train(self.training)
        return self

    def train(self, mode: bool = True) -> QATWithBn:
        """Like ``nn.Module.train``, but a frozen BN stays in eval mode."""
        super().train(mode)  # type: ignore[misc]
        if self.freeze_bn:
            self.bn.train(False)
        return self

    def _pre_activation(self, x: torch.Tensor) -> torch.Tensor:
        bn = self.bn
        scale = bn.weight / _running_std(bn)
        weight_shape = (-1,) + (1,) * (self.weight.dim() - 1)
        out_shape = (1, -1) + (1,) * (self.weight.dim() - 2)
        scaled_weight = self.weight_fake_quant(self.weight * scale.reshape(weight_shape))
        y = self._apply_weight(x, scaled_weight, None) / scale.reshape(out_shape)
        if self.bias is not None:
            y = y + self.bias.reshape(out_shape)
        return bn(y)

    def _float_weight_bias(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        bn = self.bn
        return fold_bn_weights(
            self.weight.detach(), None if self.bias is None else self.bias.detach(),
            bn.running_mean, bn.running_var, bn.eps, bn.weight.detach(), bn.bias.detach(),
            linear=isinstance(self, nn.Linear))


@run_eagerly
def _running_std(bn: nn.Module) -> torch.Tensor:
    """``sqrt(running_var + eps)``, computed eagerly under ``torch.compile``.

    The weight fake-quant between this read and BN's in-place update of ``running_var`` breaks
    the graph (its observer runs eagerly); AOTAutograd then saves ``running_var`` itself for the
    backward of the graph before the break, and the update in the graph after it invalidates that
    ("modified by an inplace operation" at the first backward). A tensor made outside the graph
    is saved instead. torch.ao's ConvBn avoids it by tracing its fake-quant into one graph.
    """
    return torch.sqrt(bn.running_var + bn.eps)


def freeze_bn_stats(mod: nn.Module) -> None:
    """For ``model.apply``: freeze BN statistics in every QAT module that trains a BN."""
    if isinstance(mod, QATWithBn):
        mod.freeze_bn_stats()


def update_bn_stats(mod: nn.Module) -> None:
    """For ``model.apply``: resume BN statistics updates in every QAT module that trains a BN."""
    if isinstance(mod, QATWithBn):
        mod.update_bn_stats()
