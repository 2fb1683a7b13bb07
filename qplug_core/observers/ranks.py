"""The collectives observers use to combine their statistics across the ranks of a process group.

Observers reduce through :class:`Ranks` (never ``torch.distributed`` directly) so that device
placement is handled in one place: tensors are copied to the device the group's backend reduces on
(the current CUDA device for NCCL, the CPU for gloo and the others) and the result is copied back
to wherever the observer's buffers live. ``qplug_core.observers.distributed`` decides *when* observers reduce;
this module only knows *how* to run a collective (``batch_sync`` reduces each batch's statistics).

Ranks fail together. Every collective is preceded by an agreement step (one number: whether some
rank failed), and a rank whose calibration raises takes part in the next agreement step with
:meth:`Ranks.report_failure` before it re-raises. The others, waiting in that step, learn which
rank failed and its error (``Type: message``, sent as bytes, never pickled) and raise
:class:`RankFailedError` with it, instead of waiting in a collective that never completes and
then misreporting. Every collective waits at most :func:`collective_timeout` seconds
(``QPLUG_DISTRIBUTED_TIMEOUT``, default 300): a rank that died or hangs outside qplug ends in a
:class:`DistributedCalibrationError` saying so, not in a hang.
"""

from __future__ import annotations

import datetime as dt
import os
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
#: environment variable: seconds a collective may wait for the other ranks
TIMEOUT_ENV = "QPLUG_DISTRIBUTED_TIMEOUT"
_DEFAULT_TIMEOUT = 300.0
#: bytes of a failed rank's error message sent to the others
_MESSAGE_BYTES = 4096


def collective_timeout() -> float:
    """Seconds one collective waits for the other ranks (``QPLUG_DISTRIBUTED_TIMEOUT``)."""
    text = os.environ.get(TIMEOUT_ENV, "")
    try:
        value = float(text) if text else _DEFAULT_TIMEOUT
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise DistributedCalibrationError(f"{TIMEOUT_ENV}={text!r} is not a positive number of seconds")
    return value


class RankFailedError(DistributedCalibrationError):
    """Another rank failed during distributed calibration; carries its rank and its error."""

    def __init__(self, rank: int, error: str) -> None:
        super().__init__(f"rank {rank} failed, so this rank stopped too: {error}")
        self.rank = rank
        self.error = error


class RanksLostError(DistributedCalibrationError):
    """A collective did not complete: another rank is gone or stuck outside qplug."""


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
        self.timeout = collective_timeout()
        #: set once a failure is known on every rank (or the group is lost): no more collectives
        self.stopped = False

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(timeout=dt.timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            self.stopped = True
            raise RanksLostError(
                f"rank {self.rank}: {what} failed or did not complete within {self.timeout:g} s "
                f"({exc}); "
                "another rank has stopped or is stuck outside qplug's calibration (raise "
                f"{TIMEOUT_ENV} if a rank legitimately needs longer)") from exc

    def _collective(self, tensor: torch.Tensor, op: Any) -> None:
        if self.stopped:
            raise DistributedCalibrationError(f"rank {self.rank}: the ranks have already stopped "
                                              "after a failure; start the calibration again")
        self._wait(dist.all_reduce(tensor, op=op, group=self.group, async_op=True), "a collective")

    def _agreement(self, failed: bool) -> int | None:
        """The step before each collective: the lowest failed rank, or ``None`` if none failed.

        Once a failure is known, its message travels from that rank to all the others."""
        status = torch.tensor([float(self.size - self.rank) if failed else 0.0], dtype=torch.float64,
                              device=self.device)
        self._collective(status, dist.ReduceOp.MAX)
        if int(status.item()) == 0:
            return None
        self.stopped = True
        return self.size - int(status.item())

    def _message(self, origin: int, text: str) -> str:
        """``text`` of rank ``origin``, sent to every rank as UTF-8 bytes (never pickled)."""
        data = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
        if origin == self.rank:
            raw = text.encode("utf-8", "replace")[:_MESSAGE_BYTES]
            data[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        data = data.to(self.device)
        source = origin if self.group is None else dist.get_global_rank(self.group, origin)
        self._wait(dist.broadcast(data, src=source, group=self.group, async_op=True),
                   "sending the failed rank's error")
        return bytes(data.cpu().tolist()).rstrip(b"\0").decode("utf-8", "replace")

    def report_failure(self, error: BaseException) -> None:
        """On the rank where calibration raised ``error``: tell the others, then return (the
        caller re-raises). Does nothing once the ranks have stopped."""
        if self.stopped or isinstance(error, (RankFailedError, RanksLostError)):
            return
        try:
            origin = self._agreement(failed=True)
            if origin is not None:
                self._message(origin, f"{type(error).__name__}: {error}")
        except DistributedCalibrationError:
            pass  # the others are gone: this rank's own error is what its caller raises

    def _reduce(self, tensor: torch.Tensor, op: Any) -> torch.Tensor:
        work = tensor.detach().to(self.device, copy=True).contiguous()
        origin = self._agreement(failed=False)
        if origin is not None:
            raise RankFailedError(origin, self._message(origin, ""))
        self._collective(work, op)
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
