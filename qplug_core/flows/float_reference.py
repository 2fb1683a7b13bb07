"""The float model as qplug runs it to compare with the int8 model: torch's attention fast path off.

``nn.TransformerEncoder`` in eval mode, called with a ``src_key_padding_mask``, takes torch's
nested-tensor fast path: it returns zeros at the padded positions, and its layers pass
NestedTensors along. torch.export traces the ordinary path, so the int8 model computes those
positions like any other. A whole-output comparison of a model fine on its real rows (42.7 dB)
then read 4.8 dB, and ``qp.compare``'s layer recorder crashed on the NestedTensors. Every
comparison runs the float model with the fast path off (torch's global switch, put back after),
and the first time qplug sees an encoder called so, it tells the user that their float model
zeroes those positions where the int8 model computes them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from qplug_core.errors import warn_user

__all__ = ["float_like_int8", "noting_padding_fast_path"]


@contextlib.contextmanager
def float_like_int8(*models: nn.Module) -> Iterator[None]:
    """Run ``models`` (the float side of a comparison) with the attention fast path off."""
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with noting_padding_fast_path(*models):
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)


@contextlib.contextmanager
def noting_padding_fast_path(*models: nn.Module) -> Iterator[None]:
    """While ``models`` run, note (once per process) an encoder that zeroes padded positions."""
    handles = [module.register_forward_pre_hook(_note_padding_mask, with_kwargs=True)
               for model in models for module in model.modules()
               if isinstance(module, nn.TransformerEncoder) and module.use_nested_tensor]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _note_padding_mask(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    mask = kwargs.get("src_key_padding_mask", args[2] if len(args) > 2 else None)
    if mask is not None and not module.training:
        _note_once()


@functools.cache
def _note_once() -> None:
    warn_user("an nn.TransformerEncoder in eval mode called with src_key_padding_mask runs torch's "
              "nested-tensor fast path, which returns zeros at the padded positions; the int8 model "
              "computes those positions like the others (as the float model does with "
              "torch.backends.mha.set_fastpath_enabled(False), which qplug's comparisons use). Mask the "
              "padded positions before pooling or comparing outputs")
