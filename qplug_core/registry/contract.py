"""What a plugin declares about a backend: :class:`BackendSpec`, :class:`Availability`,
:class:`Diagnostic` and, for a backend that compiles whole partitions, :class:`Delegate`.

A leaf module (at run time it imports only :mod:`qplug_core.errors`): the hook contract types live here, apart
from the registry that assembles backends (:mod:`qplug_core.registry.backends`), so that hookspecs, the
plugin manager and plugins can name them without importing the registry.
"""

from __future__ import annotations

import importlib.util
import platform
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from qplug_core.errors import ConfigValidationError

if TYPE_CHECKING:
    import torch
    from torch import fx, nn

    from qplug_core.kernels.arithmetic import Int8Arithmetic
    from qplug_core.kernels.pair_sums_probe import Gemm
    from qplug_core.partition import OperatorSupportBase

X86_MACHINES = ("x86_64", "amd64", "i386", "i686")
ARM_MACHINES = ("aarch64", "arm64", "armv7l", "armv8l")
#: the kinds of weighted op ``BackendSpec.float_outputs`` names: a linear (a 2-D weight: a
#: matmul) and a convolution (a weight of more dimensions)
WEIGHTED_OP_KINDS = ("linear", "conv")


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run on this machine, and if not, why (one line a user can act on)."""

    ok: bool
    reason: str = ""


def always_available() -> Availability:
    return Availability(True)


def platform_name() -> str:
    return f"{platform.system()} {platform.machine()}"


def engine_availability(engine: str, *, machines: tuple[str, ...] = ()) -> Availability:
    """Availability of a backend whose kernels need a ``torch.backends.quantized`` engine.

    ``machines`` restricts it to CPU architectures (``platform.machine()``, lower case).
    """
    import torch

    engines = list(torch.backends.quantized.supported_engines)
    if engine not in engines:
        return Availability(False, f"engine {engine!r} not in torch.backends.quantized."
                                   f"supported_engines {engines} (torch {torch.__version__}, "
                                   f"{platform_name()})")
    if machines and platform.machine().lower() not in machines:
        return Availability(False, f"engine {engine!r} needs a {'/'.join(machines)} CPU, "
                                   f"this is {platform_name()}")
    return Availability(True)


def packages_availability(packages: tuple[str, ...], dist: str) -> Availability:
    """Availability of a backend whose runtime is the Python ``packages`` (importable, not imported);
    the reason names the missing ones and ``pip install dist`` (the plugin's distribution)."""
    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    if missing:
        return Availability(False, f"missing Python package(s) {', '.join(missing)}; "
                                   f"pip install {dist} installs them")
    return Availability(True)


@dataclass(frozen=True)
class BackendSpec:
    """A backend as a plugin declares it through ``qplug_register_backends``.

    ``engine`` is the ``torch.backends.quantized`` engine its kernels pack weights for (``None`` for
    backends that need no engine, like ``reference``); ``arithmetic`` how its kernels accumulate
    int8 products (``None``: as ``engine``'s kernels do), from which the core derives safe qparams
    and warns about a user qconfig that would saturate on this CPU. ``pairs_in_torch_order``: the
    kernels add the products of adjacent K in PyTorch's order (a linear's ``in_features``, a conv's
    packing as in ``kernels/pair_sums.py``), so the core's emulation of their int16 pair sums holds
    and convert may give a layer 8-bit weights where it finds them safe; False for a runtime that
    lays operands out itself (OpenVINO's blocked layouts pair other products): 7-bit weights for
    every layer on CPUs without VNNI. ``int8_gemm`` gives the kernels' u8 x s8 product (or
    ``None``), measured once per process where the CPU's flags say the kernels are exact
    (``kernels/pair_sums_probe.py``): a library held below the CPU's instructions then gets the
    safe qparams too. ``float_outputs``: the runtime runs a weighted op on int8 inputs and
    weights into a float output (the dequantization fused into the op, as OpenVINO's
    FullyConnected and Convolution do), so a weighted op whose output no int8 op reads keeps it
    float instead of quantizing it for nothing (a transformer's FFN output feeding the residual
    add: its massive activations cost every other value its resolution on a per-tensor grid).
    ``True`` says so of every weighted op; a set of kinds from :data:`WEIGHTED_OP_KINDS` of those
    only (ONNX Runtime's ``{"linear"}``: it fuses a dequantized matmul with no QuantizeLinear
    after it into MatMulIntegerToFloat, but has no int8 convolution with a float output, so such
    a conv would run in float). Stored as the frozenset of kinds (``True``: all of them).
    """

    name: str
    description: str
    engine: str | None = None
    is_available: Callable[[], Availability] = field(default=always_available, compare=False)
    arithmetic: Int8Arithmetic | None = None
    pairs_in_torch_order: bool = True
    float_outputs: bool | frozenset[str] = False
    int8_gemm: Callable[[], Gemm | None] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "float_outputs", float_output_kinds(self.float_outputs))


def float_output_kinds(declared: object) -> frozenset[str]:
    """The weighted op kinds a ``float_outputs`` declaration names (see :class:`BackendSpec`)."""
    if isinstance(declared, bool):
        return frozenset(WEIGHTED_OP_KINDS if declared else ())
    if isinstance(declared, (set, frozenset, tuple, list)) and set(declared) <= set(WEIGHTED_OP_KINDS):
        return frozenset(declared)
    raise ConfigValidationError(f"float_outputs must be True, False or a set of the op kinds "
                                f"{WEIGHTED_OP_KINDS}, got {declared!r}", field="float_outputs", value=declared)


DIAGNOSTIC_LEVELS = ("ok", "warning", "error")


@dataclass(frozen=True)
class Diagnostic:
    """One finding of ``qplug doctor``; ``hint`` says what to do about a warning or error."""

    level: str
    message: str
    hint: str = ""

    def __post_init__(self) -> None:
        if self.level not in DIAGNOSTIC_LEVELS:
            raise ConfigValidationError(
                f"Diagnostic level must be one of {DIAGNOSTIC_LEVELS}, got {self.level!r}",
                field="level", value=self.level)


@dataclass(frozen=True)
class Delegate:
    """What a compiling backend contributes (returned by the ``qplug_delegate`` hook).

    ``compile(partition, example_inputs)`` receives one partition as a GraphModule in reference
    form (Quantize/Dequantize modules, ``ReferenceWeighted`` layers) and a tuple of tensors it can
    be called with, and must not modify the partition (the reference form qplug keeps and saves);
    it returns the module that replaces it (same inputs, same outputs). It runs at convert and
    again at the first call of a model ``qp.load`` rebuilt, on that call's inputs. A compile that
    raises at convert leaves that partition in reference form, with a warning and the reason in
    the report.
    """

    operator_support: OperatorSupportBase
    compile: Callable[[fx.GraphModule, tuple[torch.Tensor, ...]], nn.Module]
    allows_single_node_partition: bool = True


__all__ = ["ARM_MACHINES", "DIAGNOSTIC_LEVELS", "X86_MACHINES", "Availability", "BackendSpec",
           "Delegate", "Diagnostic", "always_available", "engine_availability", "platform_name"]
