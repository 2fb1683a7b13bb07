"""The collectives observers use to combine their statistics across the ranks of a process group.

Observers reduce through :class:`Ranks` (never ``torch.distributed`` directly) so that device
placement is handled in one place: tensors are copied to the device the group's backend reduces on
(the current CUDA device for NCCL, the CPU for gloo and the others) and the result is copied back
to wherever the observer's buffers live. ``qplug_core.observers.distributed`` decides *when* observers reduce;
this module only knows *how* to run a collective (``batch_sync`` reduces each batch's statistics).
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from qplug_core.errors import DistributedCalibrationError

#: methods through which an observer or fake-quant class gathers statistics: a class that
#: (re)defines one of them must also (re)define ``reduce_across_ranks`` (see ``declares_reduction``)
STATISTICS_METHODS = ("forward", "_update", "_combine", "_update_qparams", "_batch_counts",
                      "_apply_batch")

#: backends that reduce on an accelerator, and which one (the process's current device of it)
_DEVICE_OF_BACKEND = {"nccl": "cuda", "xccl": "xpu"}


class Ranks:
    """The ranks of ``group`` (the default group when ``None``), with exact reductions over them."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        backend = str(dist.get_backend(group)).lower()
        kind = _DEVICE_OF_BACKEND.get(backend)
        self.device = (torch.device(kind, getattr(torch, kind).current_device()) if kind
                       else torch.device("cpu"))

    def _reduce(self, tensor: torch.Tensor, op: Any) -> torch.Tensor:
        work = tensor.detach().to(self.device, copy=True).contiguous()
        dist.all_reduce(work, op=op, group=self.group)
        return work.to(tensor.device)

    def total(self, tensor: torch.Tensor) -> torch.Tensor:
        """Elementwise sum over the ranks (exact for integer counts below 2**24 in float32)."""
        return self._reduce(tensor, dist.ReduceOp.SUM)

    def min_max(self, low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Elementwise (min over ranks of ``low``, max over ranks of ``high``) in one collective.

        ``max(h) = -min(-h)`` is exact, so both travel in one MIN reduction.
        """
        packed = torch.cat([low.reshape(-1), -high.reshape(-1)])
        reduced = self._reduce(packed, dist.ReduceOp.MIN)
        n = low.numel()
        return reduced[:n].reshape(low.shape), -reduced[n:].reshape(high.shape)

    def identical(self, *tensors: torch.Tensor) -> bool:
        """Whether every rank holds the same values in ``tensors`` (same shapes required)."""
        flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])
        low, high = self.min_max(flat, flat)
        return torch.equal(low, high)

    def agree(self, value: float) -> tuple[float, float]:
        """(min, max) of a number over the ranks, e.g. to check that every rank has the same count."""
        low, high = self.min_max(torch.tensor([float(value)], dtype=torch.float64),
                                 torch.tensor([float(value)], dtype=torch.float64))
        return float(low), float(high)


def declares_reduction(cls: type) -> bool:
    """Whether ``cls`` says how its own statistics reduce across ranks.

    A subclass inherits its parent's rule only if it does not change how statistics are gathered:
    the class defining ``reduce_across_ranks`` must be (a subclass of) every class in the MRO that
    defines one of :data:`STATISTICS_METHODS`.
    """

    def definer(name: str) -> type | None:
        return next((k for k in cls.__mro__ if name in vars(k)), None)

    reducer = definer("reduce_across_ranks")
    if reducer is None or getattr(vars(reducer)["reduce_across_ranks"], "undeclared", False):
        return False
    return all(issubclass(reducer, owner) for name in STATISTICS_METHODS
               if (owner := definer(name)) is not None and owner is not nn.Module)


def refuse_reduction(module: nn.Module) -> NoReturn:
    """What ``reduce_across_ranks`` does in a class that has not declared its rule."""
    cls = type(module)
    raise DistributedCalibrationError(
        f"{cls.__module__}.{cls.__qualname__} does not declare how its statistics reduce across "
        "ranks, so it cannot take part in distributed calibration or QAT; implement "
        "reduce_across_ranks(ranks) (see docs/guide/distributed.md)")
