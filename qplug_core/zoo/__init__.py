"""Reference architectures that quantization flows and backends are tested and benchmarked on.

Each model is registered by name with a builder and a function making example inputs, so tests,
benchmarks and the docs all ask for models the same way::

    model = get_model("resnet18", seed=0)
    out = model(*example_inputs("resnet18", batch=2))

Nothing here downloads weights or data: models are randomly initialised like their upstream
originals (or trained in seconds, see :func:`~qplug_core.zoo.digits.train_digits_cnn`). For
trained-like activation ranges in the CNNs, re-estimate BatchNorm statistics first::

    calibrate_batchnorm(model, [example_inputs("resnet18", batch=8, seed=s) for s in range(2)])
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from qplug_core.errors import ConfigError, did_you_mean
from qplug_core.zoo._rng import seeded
from qplug_core.zoo.batchnorm import calibrate_batchnorm
from qplug_core.zoo.digits import digits_cnn
from qplug_core.zoo.lstm import gru_classifier, lstm_classifier
from qplug_core.zoo.mobilenet import mobilenet_v2
from qplug_core.zoo.resnet import resnet18, resnet50
from qplug_core.zoo.transformer import bert_encoder

__all__ = ["ZooEntry", "calibrate_batchnorm", "example_inputs", "get_model", "list_models"]


def _images(size: int, channels: int = 3) -> Callable[..., tuple[torch.Tensor, ...]]:
    def make(batch: int, gen: torch.Generator, **_: Any) -> tuple[torch.Tensor, ...]:
        return (torch.randn(batch, channels, size, size, generator=gen),)
    return make


def _token_batch(batch: int, gen: torch.Generator, vocab_size: int = 1000, max_len: int = 64,
                 **_: Any) -> tuple[torch.Tensor, ...]:
    """Token ids plus a mask whose odd rows end in padding, so masking is always exercised."""
    seq = min(16, max_len)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.int64)
    mask[1::2, seq * 3 // 4:] = 0
    return ids, mask


def _sequences(batch: int, gen: torch.Generator, input_size: int = 32,
               vocab_size: int | None = None, **_: Any) -> tuple[torch.Tensor, ...]:
    if vocab_size:
        return (torch.randint(0, vocab_size, (batch, 8), generator=gen),)
    return (torch.randn(batch, 8, input_size, generator=gen),)


@dataclass(frozen=True)
class ZooEntry:
    """A registered model: ``build(**kw)`` and ``inputs(batch, generator, **kw)`` share kwargs."""

    name: str
    build: Callable[..., nn.Module]
    inputs: Callable[..., tuple[torch.Tensor, ...]]


_REGISTRY: dict[str, ZooEntry] = {e.name: e for e in [
    ZooEntry("resnet18", resnet18, _images(224)),
    ZooEntry("resnet50", resnet50, _images(224)),
    ZooEntry("mobilenet_v2", mobilenet_v2, _images(224)),
    ZooEntry("bert_encoder", bert_encoder, _token_batch),
    ZooEntry("lstm_classifier", lstm_classifier, _sequences),
    ZooEntry("gru_classifier", gru_classifier, _sequences),
    ZooEntry("digits_cnn", digits_cnn, _images(8, channels=1)),
]}


def _entry(name: str) -> ZooEntry:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"unknown zoo model {name!r}{did_you_mean(name, _REGISTRY)}; "
            f"available: {', '.join(list_models())}", field="name", value=name) from None


def list_models() -> list[str]:
    """Names accepted by :func:`get_model`, sorted."""
    return sorted(_REGISTRY)


def get_model(name: str, *, seed: int | None = None, train: bool = False, **kw: Any) -> nn.Module:
    """Build zoo model ``name`` with builder kwargs ``kw``.

    ``seed`` makes the random init reproducible without touching the caller's RNG; models come
    back in eval mode (what post-training quantization expects) unless ``train=True``.
    """
    entry = _entry(name)
    params = inspect.signature(entry.build).parameters
    for key in kw:
        if key not in params:
            raise ConfigError(
                f"{name} has no option {key!r}{did_you_mean(key, params)}; "
                f"options: {', '.join(params)}", field=key, value=kw[key])
    with seeded(seed):
        model = entry.build(**kw)
    return model.train(train)


def example_inputs(name: str, batch: int = 1, *, seed: int = 0,
                   **kw: Any) -> tuple[torch.Tensor, ...]:
    """Deterministic positional inputs for ``get_model(name, **kw)`` (pass the same ``kw``)."""
    return _entry(name).inputs(batch, torch.Generator().manual_seed(seed), **kw)
