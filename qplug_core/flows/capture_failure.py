"""What a user reads when neither torch.export nor symbolic tracing captures a model: torch.export's
error first (the one to act on: a Hugging Face model's is the model's own), symbolic tracing's only
where it says something (on a packed sequence the tracer fails on a CUDA attribute), and the route
that needs no graph when the model has layers ``qp.quantize_dynamic`` swaps.
"""

from __future__ import annotations

import os
from typing import Iterator

from torch import nn

from qplug_core.errors import first_line

#: torch's packing helpers (``pack_padded_sequence``, ``PackedSequence``): neither capture takes them
_PACKING_FILE = os.path.join("nn", "utils", "rnn.py")


def both_failed(model: nn.Module, symbolic: BaseException, export: BaseException) -> str:
    """Why ``model`` (or a submodule) cannot be captured, and what to do instead."""
    if _through_packing(symbolic) or _through_packing(export):
        why = (f"it packs sequences (torch.nn.utils.rnn.pack_padded_sequence / PackedSequence), which "
               f"neither capture takes ({export}); pad and mask instead")
    else:
        why = f"{export}; symbolic tracing: {first_line(symbolic)}"
    return why.rstrip(".") + _module_swap_route(model)


def _module_swap_route(model: nn.Module) -> str:
    from qplug_core.flows.dynamic import DYNAMIC_TYPES  # it imports capture, which imports this

    layers: dict[str, int] = {}
    for module in model.modules():
        if type(module) in DYNAMIC_TYPES:
            layers[type(module).__name__] = layers.get(type(module).__name__, 0) + 1
    if not layers:
        return ""
    held = ", ".join(f"{n} {kind}" for kind, n in layers.items())
    return (f". qp.quantize_dynamic(model, backend='fbgemm') needs no graph: it swaps Linear/LSTM/GRU "
            f"layers (here {held}) for int8 ones")


def _through_packing(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) was raised inside torch's sequence packing."""
    return any(frame.f_code.co_filename.endswith(_PACKING_FILE) for frame in _frames(error))


def _frames(error: BaseException | None) -> Iterator:
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        tb = error.__traceback__
        while tb is not None:
            yield tb.tb_frame
            tb = tb.tb_next
        error = error.__cause__ or error.__context__
