"""Latency and size measurements shared by ``qplug demo`` and ``qplug bench``.

Latency is timed *interleaved* (float, int8, float, int8, ... with the order flipped every run)
so that a noisy, shared machine slows both models alike instead of biasing one of them, and on
one thread by default: on a busy machine torch's worker threads wait for each other and a few runs
take 100x the median.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from qplug_core.cli._common import number
from qplug_core.errors import SerializationError

WARMUP_RUNS = 3


@dataclass(frozen=True)
class Latency:
    median_ms: float
    p10_ms: float
    p90_ms: float

    @property
    def spread(self) -> float:
        """Run-to-run spread relative to the median: (p90 - p10) / median."""
        return (self.p90_ms - self.p10_ms) / self.median_ms

    def to_dict(self) -> dict[str, Any]:
        return {"median_ms": number(self.median_ms), "p10_ms": number(self.p10_ms),
                "p90_ms": number(self.p90_ms), "spread": number(self.spread, 3)}


def _latency(samples: list[float]) -> Latency:
    ordered = sorted(samples)

    def at(fraction: float) -> float:
        return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] * 1e3

    return Latency(statistics.median(ordered) * 1e3, at(0.1), at(0.9))


def interleaved_latency(float_model: nn.Module | None, int8_model: nn.Module, inputs: tuple,
                        runs: int, *, threads: int = 1, advance: Callable[[], Any] = lambda: None
                        ) -> tuple[Latency | None, Latency]:
    """``(float, int8)`` latency over ``runs`` alternating calls each, after a short warm-up, on
    ``threads`` torch threads (the caller's setting is restored). Without a float model only
    the int8 one is timed."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    models = [m for m in (float_model, int8_model) if m is not None]
    try:
        with torch.no_grad():
            timed = _time(models, inputs, runs, advance)
    finally:
        torch.set_num_threads(previous)
    return (timed[0] if float_model is not None else None), timed[-1]


def _time(models: list[nn.Module], inputs: tuple, runs: int,
          advance: Callable[[], Any]) -> list[Latency]:
    for _ in range(WARMUP_RUNS):
        for model in models:
            model(*inputs)
    samples: list[list[float]] = [[] for _ in models]
    order = list(range(len(models)))
    for _ in range(runs):
        for index in order:
            start = time.perf_counter()
            models[index](*inputs)
            samples[index].append(time.perf_counter() - start)
        order.reverse()  # each model goes first every other run
        advance()
    return [_latency(s) for s in samples]


def latency_document(float_latency: Latency | None, int8_latency: Latency, *, runs: int,
                     batch: int, threads: int) -> dict[str, Any]:
    """Latencies as JSON; ``speedup`` (int8 over float) only when float was timed."""
    return {"runs": runs, "batch": batch, "threads": threads,
            "float": float_latency.to_dict() if float_latency else None,
            "int8": int8_latency.to_dict(),
            "speedup": (number(float_latency.median_ms / int8_latency.median_ms, 2)
                        if float_latency else None)}


@dataclass(frozen=True)
class Size:
    float_bytes: int
    int8_bytes: int
    method: str
    #: size of the whole ``qp.save`` file (tensors plus its JSON graph description), when saved
    file_bytes: int | None = None
    #: why the fallback method was used, if it was
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"float_bytes": self.float_bytes, "int8_bytes": self.int8_bytes,
                "ratio": number(self.float_bytes / self.int8_bytes, 2), "method": self.method,
                "file_bytes": self.file_bytes, "note": self.note}


def model_sizes(float_model: nn.Module, int8_model: nn.Module) -> Size:
    """Weight bytes: the tensors of the ``qp.save`` file against the float state_dict's (the file
    also carries a JSON graph, reported as ``file_bytes``); where the model cannot be saved, the
    tensor bytes of both models (packed weights unpacked)."""
    from safetensors import safe_open

    import qplug_core as qp

    float_bytes = sum(t.numel() * t.element_size() for t in float_model.state_dict().values())
    try:
        with tempfile.TemporaryDirectory() as scratch:
            path = qp.save(int8_model, Path(scratch) / "model.safetensors")
            with safe_open(str(path), framework="pt") as saved:
                int8_bytes = sum(saved.get_tensor(k).nbytes for k in saved.keys())
            file_bytes = path.stat().st_size
    except SerializationError as exc:
        return Size(_tensor_bytes(float_model), _tensor_bytes(int8_model),
                    "tensor bytes of both models, packed weights included (qp.save could not "
                    "save this model)", note=str(exc))
    return Size(float_bytes, int8_bytes, "tensor bytes of the qp.save file vs the float state_dict",
                file_bytes=file_bytes)


def _tensor_bytes(model: nn.Module) -> int:
    """Bytes of every tensor in the state_dict plus those inside packed-weight objects, which
    torch's quantized kernels keep outside the state_dict."""
    from qplug_core.ir.tracing import reading_state_dict
    from qplug_core.kernels.base import quiet_quantized_dtypes

    with reading_state_dict():
        total = sum(t.numel() * t.element_size() for t in model.state_dict().values()
                    if isinstance(t, torch.Tensor))
    with quiet_quantized_dtypes():
        for module in model.modules():
            for value in vars(module).values():
                if isinstance(value, torch.ScriptObject) and hasattr(value, "__getstate__"):
                    total += sum(t.numel() * t.element_size() for t in _tensors(value.__getstate__()))
    return total


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, (tuple, list)):
        return [t for item in state for t in _tensors(item)]
    return []
