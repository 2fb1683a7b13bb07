"""Filling a model built on the meta device (``with torch.device("meta"): model = Cls(config)``).

Such a model allocates nothing, so ``qp.load`` does not build a float model only to throw its
linears away: the file's tensors become the model's own (``load_state_dict(..., assign=True)``).
What no file holds are the buffers a model computes when it is built and does not save (a rotary
embedding's frequencies): the model computes them again itself (Hugging Face's ``_init_weights``
of the module holding them), or the model is refused by name.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from qplug_core.errors import SerializationError


def on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def identity(model: nn.Module) -> dict[str, int]:
    """Each parameter and buffer key -> what tells tied tensors apart: the memory it points to, or
    the tensor object itself on the meta device (where every tensor points to 0)."""
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return {key: id(tensor) if tensor.is_meta else tensor.data_ptr() for key, tensor in named}


def compute_unsaved_buffers(model: nn.Module, source: Path) -> None:
    """Give the meta buffers no file holds (``state_dict`` leaves them out) their values, computed by
    the model; refuse, naming them, when it cannot."""
    owners = [(name, module) for name, module in model.named_modules()
              if any(_unsaved_meta(module, buffer) for buffer in module._buffers)]
    initialise = getattr(model, "_init_weights", None)
    if owners and not callable(initialise):
        names = [f"{name}.{b}".lstrip(".") for name, module in owners for b in module._buffers
                 if _unsaved_meta(module, b)]
        raise SerializationError(
            f"{source}: the model given to qp.load was built on the meta device and {', '.join(names[:5])} "
            "are not saved in any file (the model computes them when it is built), and it has no "
            "_init_weights to compute them again: build the model on the CPU, or those modules outside "
            "torch.device('meta')", path=str(source))
    for _, module in owners:
        for buffer, value in list(module._buffers.items()):
            if _unsaved_meta(module, buffer):
                module.register_buffer(buffer, torch.empty_like(value, device="cpu"), persistent=False)
        initialise(module)  # type: ignore[misc]


def _unsaved_meta(module: nn.Module, buffer: str) -> bool:
    value = module._buffers[buffer]
    return value is not None and value.is_meta and buffer in module._non_persistent_buffers_set
