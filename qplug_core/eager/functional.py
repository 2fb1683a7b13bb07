"""FloatFunctional / QFunctional: tensor arithmetic an eager model can observe and quantize.

Eager mode quantizes *modules*, so a residual ``a + b`` written with ``+`` is invisible to it. Models
write ``self.skip.add(a, b)`` instead: in float (and after prepare) each op's result goes through
``activation_post_process`` (identity, then an observer); convert swaps the module for a
:class:`QFunctional` whose ops run the backend's int8 kernels with the observed output qparams.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qplug_core.errors import ConfigValidationError, ConstraintViolationError
from qplug_core.kernels.base import KernelContext, KernelSpec, TensorArg
from qplug_core.qparams import QParams

#: FloatFunctional op -> the kernel-table pattern (complex format) its int8 version runs
OP_PATTERNS: dict[str, Any] = {
    "add": torch.add, "add_relu": (torch.relu, torch.add), "mul": torch.mul,
    "mul_relu": (torch.relu, torch.mul), "cat": torch.cat, "matmul": torch.matmul,
}


def _no_forward(module: nn.Module) -> None:
    raise ConfigValidationError(
        f"{type(module).__name__} has no forward(); call one of its ops instead "
        f"(add, add_relu, mul, mul_relu, matmul, cat, add_scalar, mul_scalar)", field="forward")


class FloatFunctional(nn.Module):
    """Float tensor ops whose outputs prepare can observe (one instance per op site)."""

    def __init__(self) -> None:
        super().__init__()
        self.activation_post_process: nn.Module = nn.Identity()

    def forward(self, *args: Any) -> Any:
        _no_forward(self)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.activation_post_process(torch.add(x, y))

    def add_relu(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.activation_post_process(torch.relu(torch.add(x, y)))

    def mul(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.activation_post_process(torch.mul(x, y))

    def mul_relu(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.activation_post_process(torch.relu(torch.mul(x, y)))

    def matmul(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.activation_post_process(torch.matmul(x, y))

    def cat(self, x: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
        return self.activation_post_process(torch.cat(x, dim=dim))

    def add_scalar(self, x: torch.Tensor, y: float) -> torch.Tensor:
        return self.activation_post_process(torch.add(x, y))

    def mul_scalar(self, x: torch.Tensor, y: float) -> torch.Tensor:
        return self.activation_post_process(torch.mul(x, y))


class QFunctional(nn.Module):
    """int8 twin of :class:`FloatFunctional`: the backend's add/mul/cat kernels, one output qparams.

    A kernel is built on first use for each (op, scalar or dim) — building one packs nothing, and
    ``add_scalar``'s scalar or ``cat``'s dim is only known at the call.
    """

    def __init__(self, specs: dict[str, KernelSpec | None], output_qparams: QParams,
                 engine: str | None, backend: str) -> None:
        super().__init__()
        self._specs, self._qparams, self.engine, self.backend = specs, output_qparams, engine, backend
        self._kernels: dict[tuple[str, Any], nn.Module] = {}

    def forward(self, *args: Any) -> Any:
        _no_forward(self)

    def _kernel(self, op: str, constant: Any, args: tuple, n_inputs: int) -> nn.Module:
        kernel = self._kernels.get((op, constant))
        if kernel is None:
            spec = self._specs.get(op)
            if spec is None or spec.build is None:
                raise ConstraintViolationError(
                    f"backend {self.backend!r} has no int8 kernel for FloatFunctional.{op}; give "
                    "this FloatFunctional qconfig=None and dequantize its inputs", field=op)
            kernel = spec.build(KernelContext(
                pattern=OP_PATTERNS[op], module=None, target=OP_PATTERNS[op], args=args,
                input_qparams=(self._qparams,) * n_inputs, output_qparams=self._qparams,
                engine=self.engine))
            self._kernels[(op, constant)] = kernel
        return kernel

    def _binary(self, op: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._kernel(op, None, (TensorArg(0), TensorArg(1)), 2)(x, y)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._binary("add", x, y)

    def add_relu(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._binary("add_relu", x, y)

    def mul(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._binary("mul", x, y)

    def mul_relu(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._binary("mul_relu", x, y)

    def matmul(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._binary("matmul", x, y)

    def cat(self, x: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
        args = ([TensorArg(i) for i in range(len(x))], dim)
        return self._kernel("cat", (dim, len(x)), args, len(x))(*x)

    def add_scalar(self, x: torch.Tensor, y: float) -> torch.Tensor:
        return self._kernel("add", float(y), (TensorArg(0), float(y)), 1)(x)

    def mul_scalar(self, x: torch.Tensor, y: float) -> torch.Tensor:
        return self._kernel("mul", float(y), (TensorArg(0), float(y)), 1)(x)

    def extra_repr(self) -> str:
        return (f"backend={self.backend!r}, scale={float(self._qparams.scale):.6g}, "
                f"zero_point={int(self._qparams.zero_point)}")
