"""The kernel contract: how a backend turns one quantized pattern into an int8 module."""

from qplug_core.kernels.base import (
    KernelContext,
    KernelSpec,
    TensorArg,
    engine_context,
    quiet_quantized_dtypes,
)

__all__ = ["KernelContext", "KernelSpec", "TensorArg", "engine_context", "quiet_quantized_dtypes"]
