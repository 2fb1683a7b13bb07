"""Calibration and QAT across processes with torch.distributed: observers that agree across ranks.

Observers are module buffers, so under data parallelism each rank would otherwise quantize for its
own shard of the data, and DistributedDataParallel's default ``broadcast_buffers=True`` would
replace every rank's statistics by rank 0's at each forward (pytorch#85627). Here each observer
class says how its statistics reduce (``reduce_across_ranks``, see
``qplug_core.observers.ranks``); this module decides when they do:

* during ``qp.calibrate`` (automatically when a process group of more than one rank is
  initialized): each batch's statistics are reduced before they update the observer, so the result
  is the one a single process gets on the global batches, then a final reduction checks agreement;
* in a custom loop: ``with sync_observers_each_step(model): ...`` does the same, and
  :func:`sync_observers` is the final reduction on its own;
* an error on one rank reaches the others at their next collective, with its message (see
  ``qplug_core.observers.ranks``), so that every rank stops with the original error;
* in QAT: :func:`data_parallel` wraps the prepared model in DDP with observers reduced every step
  (or every k steps) and BatchNorm statistics per SyncBatchNorm or averaged.

Every rank must run the same number of forward passes through the same model: the reductions are
collectives that wait for all ranks.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from qplug_core.errors import (
    CalibrationError,
    ConfigValidationError,
    DistributedCalibrationError,
    notify,
)
from qplug_core.observers import FakeQuantizeBase, HistogramObserver, ObserverBase
from qplug_core.observers.batch_sync import BatchReduction, reduce_each_batch
from qplug_core.observers.ranks import Ranks, declares_reduction

__all__ = ["ObserverSync", "data_parallel", "is_rank_zero", "sync_observers",
           "sync_observers_each_step"]

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)  # SyncBatchNorm agrees by itself


def active_ranks(group: Any = None) -> Ranks | None:
    """The ranks of ``group`` when a process group of more than one rank is initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    ranks = Ranks(group)
    return ranks if ranks.size > 1 else None


def is_rank_zero() -> bool:
    """True in a single process and on rank 0 of a process group (who prints and saves)."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _unwrapped(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def observer_modules(model: nn.Module) -> list[nn.Module]:
    """The fake-quant modules and the observers not inside one, in model order (same on all ranks)."""
    found: list[nn.Module] = []
    owned: set[int] = set()
    for module in _unwrapped(model).modules():
        if isinstance(module, FakeQuantizeBase):
            found.append(module)
            owned.add(id(getattr(module, "activation_post_process", None)))
        elif isinstance(module, ObserverBase) and id(module) not in owned:
            found.append(module)
    return found


def _class_name(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _checked_observers(model: nn.Module, ranks: Ranks) -> list[nn.Module]:
    """The model's observers, refusing classes without a reduction rule and differing models."""
    observers = observer_modules(model)
    inner = [getattr(m, "activation_post_process", None) for m in observers]
    refused = sorted({_class_name(m) for m in [*observers, *inner]
                      if m is not None and not declares_reduction(type(m))})
    if refused:
        raise DistributedCalibrationError(
            f"cannot make observers agree across ranks: {', '.join(refused)} "
            f"{'does' if len(refused) == 1 else 'do'} not declare how its statistics reduce "
            "(implement reduce_across_ranks(ranks); see docs/guide/distributed.md)")
    fewest, most = ranks.agree(len(observers))
    if fewest != most:
        raise DistributedCalibrationError(
            f"the ranks' models have different numbers of observers ({int(fewest)} and "
            f"{int(most)}); every rank must prepare the same model with the same qconfig mapping")
    return observers


def _average_batchnorm(model: nn.Module, ranks: Ranks) -> None:
    """Running mean/var of every (non-Sync) BatchNorm replaced by their mean over the ranks."""
    stats = [t for m in _unwrapped(model).modules() if isinstance(m, _BATCH_NORMS)
             for t in (m.running_mean, m.running_var) if isinstance(t, torch.Tensor)]
    if not stats or ranks.identical(*stats):
        return
    mean = ranks.total(torch.cat([t.reshape(-1).double() for t in stats])) / ranks.size
    offset = 0
    for t in stats:
        t.copy_(mean[offset:offset + t.numel()].reshape(t.shape))
        offset += t.numel()


def sync_observers(model: nn.Module, *, group: Any = None) -> int:
    """Make every observer (and fake-quant module) of ``model`` agree across the ranks of ``group``.

    Each observer reduces by its documented rule (docs/guide/distributed.md); BatchNorm running
    statistics, except SyncBatchNorm's, are averaged. Call it on every rank, e.g. after a custom
    calibration loop or before converting a QAT model. Returns the number of observers reduced:
    0 without a process group of more than one rank, where it does nothing.
    """
    ranks = active_ranks(group)
    if ranks is None:
        return 0
    observers = _checked_observers(model, ranks)
    with torch.no_grad():
        for observer in observers:
            observer.reduce_across_ranks(ranks)
        _average_batchnorm(model, ranks)
    return len(observers)


class ObserverSync:
    """Keeps a model's observers in agreement across ranks while attached; ``remove()`` detaches.

    ``every=1``: each observer reduces every batch's statistics before using them (the semantics
    of one process seeing the global batch): plain observers all together after each forward,
    fake-quant modules at each call. ``every=k``: observers gather statistics locally and
    reduce by their rule after every k-th forward of the model. BatchNorm running statistics are
    averaged at the same points (after each forward, with ``every=1``) while the model trains.
    Also a context manager that removes itself on exit.
    """

    def __init__(self, model: nn.Module, ranks: Ranks, every: int = 1) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ConfigValidationError(f"every must be a positive int, got {every!r}",
                                        field="every", value=every)
        if every > 1 and _broadcasts_buffers(model):
            raise ConfigValidationError(
                "this DistributedDataParallel model broadcasts rank 0's buffers at every forward "
                "(broadcast_buffers=True), which replaces the ranks' observers between syncs; "
                "build it with broadcast_buffers=False (qp.distributed.data_parallel does)",
                field="broadcast_buffers", value=True)
        self.model = _unwrapped(model)
        self.ranks = ranks
        self.every = every
        self.steps = 0
        self.observers = _checked_observers(self.model, ranks)
        if every > 1:
            _refuse_histograms(self.observers, every)
        # plain observers: every observer's batch statistics reduced together after each forward
        # (2 collectives); fake-quant needs its qparams within the forward: reduced at each call
        self._deferred = BatchReduction(ranks, deferred=True)
        immediate = BatchReduction(ranks, deferred=False)
        self._previous: dict[nn.Module, BatchReduction | None] = {}
        if every == 1:
            for module in self.observers:
                target = getattr(module, "activation_post_process", module)
                reduction = immediate if target is not module else self._deferred
                self._previous[target] = reduce_each_batch(target, reduction)
        self._hooks = [self.model.register_forward_pre_hook(self._before_forward),
                       self.model.register_forward_hook(self._after_forward)]

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if module is self.model:
            with torch.no_grad():
                self._deferred.flush()

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        # Before the next forward, not after this one: backward still needs the buffers this
        # forward used (BatchNorm's running_var, fake-quant scales) unmodified.
        if module is not self.model:  # a deep copy (convert) carries the hook along: not ours
            return
        due = self.steps > 0 and self.steps % self.every == 0
        self.steps += 1
        if not due:
            return
        with torch.no_grad():
            if self.every > 1:
                for observer in self.observers:
                    observer.reduce_across_ranks(self.ranks)
            if self.model.training:
                _average_batchnorm(self.model, self.ranks)

    def remove(self) -> None:
        """Stop reducing: observers gather local statistics again."""
        for hook in self._hooks:
            hook.remove()
        self._deferred.discard()
        for target, previous in self._previous.items():
            reduce_each_batch(target, previous)
        self._previous = {}

    def __enter__(self) -> ObserverSync:
        return self

    def __exit__(self, kind: object, error: BaseException | None, traceback: object) -> None:
        self.remove()
        if isinstance(error, Exception):  # the other ranks wait in their next collective: tell them
            self.ranks.report_failure(error)


def _refuse_histograms(observers: list[nn.Module], every: int) -> None:
    for module in observers:
        observer = getattr(module, "activation_post_process", module)
        if isinstance(observer, HistogramObserver):
            raise ConfigValidationError(
                f"{type(observer).__name__} {observer.name!r} agrees across ranks exactly only "
                f"when it reduces every batch: summing histograms every {every} steps would count "
                "the batches seen since the last sync again; use every=1",
                field="every", value=every)


def sync_observers_each_step(model: nn.Module, *, every: int = 1, group: Any = None
                             ) -> ObserverSync:
    """Attach an :class:`ObserverSync` to ``model`` (a prepared model or its DDP wrapper).

    Needs an initialized process group of more than one rank. Use it around a custom calibration
    loop (``with sync_observers_each_step(observed): ...``) or for the length of QAT training.
    """
    return ObserverSync(model, _required_ranks(group), every)


def _required_ranks(group: Any) -> Ranks:
    ranks = active_ranks(group)
    if ranks is None:
        raise DistributedCalibrationError(
            "no torch.distributed process group of more than one rank is initialized; call "
            "torch.distributed.init_process_group first (torchrun sets up the environment)")
    return ranks


def data_parallel(prepared: nn.Module, *, sync_every: int = 1, sync_batchnorm: bool = False,
                  group: Any = None, **ddp_options: Any) -> DistributedDataParallel:
    """Wrap a ``qp.prepare_qat_fx`` model in DistributedDataParallel with agreeing observers.

    Fake-quant observers reduce every step (``sync_every=1``, the semantics of one process seeing
    the global batch) or every ``sync_every`` steps (their rule, e.g. the mean of moving
    averages). ``broadcast_buffers`` is off: broadcasting rank 0's buffers is what makes torch.ao
    observers reflect rank 0's data only. BatchNorm statistics come from ``SyncBatchNorm`` with
    ``sync_batchnorm=True`` (GPU only, as torch's SyncBatchNorm), else the ranks' running
    statistics are averaged at every sync. ``ddp.observer_sync.remove()`` stops the reductions.
    """
    for option in _BUFFER_BROADCAST_OPTIONS:
        if ddp_options.pop(option, False):
            raise ConfigValidationError(
                f"{option}=True would replace every rank's observers, fake-quant qparams and "
                "BatchNorm statistics by rank 0's at each forward; qplug keeps them in agreement "
                "itself, so leave it out", field=option, value=True)
    ranks = _required_ranks(group)
    if sync_batchnorm:
        if any(p.device.type == "cpu" for p in prepared.parameters()):
            raise ConfigValidationError(
                "sync_batchnorm=True needs the model on a GPU (torch's SyncBatchNorm refuses CPU "
                "tensors); on CPU leave it False and qplug averages the BatchNorm running "
                "statistics across ranks", field="sync_batchnorm", value=True)
        prepared = nn.SyncBatchNorm.convert_sync_batchnorm(prepared, process_group=group)
    sync = ObserverSync(prepared, ranks, sync_every)
    options: dict[str, Any] = {**_no_buffer_broadcast(), **ddp_options}
    ddp = DistributedDataParallel(prepared, process_group=group, **options)
    ddp.observer_sync = sync  # type: ignore[assignment]  # a plain attribute, not a submodule
    return ddp


#: DDP's switches for broadcasting rank 0's buffers at every forward (torch 2.13 renamed it)
_BUFFER_BROADCAST_OPTIONS = ("broadcast_buffers", "forward_sync_buffers")


def _no_buffer_broadcast() -> dict[str, bool]:
    """DDP keyword turning the per-forward broadcast off, in this torch's spelling."""
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers": False}


def _broadcasts_buffers(model: nn.Module) -> bool:
    return isinstance(model, DistributedDataParallel) and bool(
        getattr(model, "forward_sync_buffers", getattr(model, "broadcast_buffers", False)))


# -- what qp.calibrate and the qplug command use ------------------------------------------------


class _LocalCalibration:
    """A single process: batches as they come, counts as they are."""

    def steps(self, batches: Iterable[tuple]) -> Iterator[tuple]:
        return iter(batches)

    def total(self, count: int) -> int:
        return count


class _RanksCalibration(_LocalCalibration):
    """Every rank takes a batch together, or the ranks stop together (else a clear error)."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks

    def steps(self, batches: Iterable[tuple]) -> Iterator[tuple]:
        end: Any = object()
        iterator = iter(batches)
        for index in range(sys.maxsize):
            batch = next(iterator, end)
            fewest, most = self.ranks.agree(0.0 if batch is end else 1.0)
            if fewest != most:
                raise DistributedCalibrationError(
                    f"the ranks ran out of calibration batches at different steps (step {index}, "
                    f"rank {self.ranks.rank} {'has none left' if batch is end else 'has more'}): "
                    "every rank must calibrate on the same number of batches; shard with a "
                    "DistributedSampler (it pads the shards to equal length)")
            if batch is end:
                return
            yield batch

    def total(self, count: int) -> int:
        return int(self.ranks.total(torch.tensor([count], dtype=torch.float64)))


@contextlib.contextmanager
def calibration_session(model: nn.Module) -> Iterator[_LocalCalibration]:
    """Reduce each batch's statistics across ranks while calibrating, then agree once more.

    Without a process group of more than one rank, nothing changes. On an error the final
    reduction is skipped (the other ranks may no longer be there to join it).
    """
    ranks = active_ranks()
    if ranks is None:
        yield _LocalCalibration()
        return
    with ObserverSync(model, ranks, every=1) as sync:
        yield _RanksCalibration(ranks)
    with torch.no_grad():
        for observer in sync.observers:
            observer.reduce_across_ranks(ranks)


@contextlib.contextmanager
def process_group_from_env() -> Iterator[None]:
    """Join the process group torchrun describes in the environment (gloo, CPU) for a command."""
    joining = (int(os.environ.get("WORLD_SIZE", "1")) > 1 and dist.is_available()
               and not dist.is_initialized())
    if not joining:
        yield
        return
    dist.init_process_group("gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()


def shard_by_rank(batches: list) -> list:
    """This rank's calibration batches: rank r takes batches r, r + W, r + 2W, ... of W ranks.

    So global step t is batches tW .. tW + W - 1 together. A remainder that cannot be shared
    evenly is left out, with a warning on rank 0.
    """
    ranks = active_ranks()
    if ranks is None:
        return batches
    usable = len(batches) - len(batches) % ranks.size
    if usable == 0:
        raise CalibrationError(f"{len(batches)} calibration batch(es) cannot be shared by "
                               f"{ranks.size} ranks; give at least one batch per rank")
    if usable < len(batches) and ranks.rank == 0:
        notify(f"calibrating on the first {usable} of {len(batches)} batches so that each of the "
               f"{ranks.size} ranks gets {usable // ranks.size}")
    return batches[ranks.rank:usable:ranks.size]
