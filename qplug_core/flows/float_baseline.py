"""``backend="auto"``'s yardstick: the float model, timed in the same rounds as the int8 candidates.

Int8 is not always faster: at batch 1 a small model's time goes to quantize/dequantize steps and
call overhead (PatchTST: 0.88x the float model's speed), and static quantization leaves LSTM/GRU
layers float, so a forecaster built on them only gains q/dq steps (0.91x). Timing the candidates
only against each other returned such a model without a word; this says so, and what may help.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn

from qplug_core.errors import warn_user
from qplug_core.flows.pipeline import eval_mode
from qplug_core.flows.raise_aten import exported_module

#: the report's row for the float model (``report.auto``; its status is ``"baseline"``)
BASELINE = "float (baseline)"
#: recurrent layers static quantization leaves float (their int8 kernels are dynamic only)
_RECURRENT = (nn.LSTM, nn.GRU, nn.RNN)

#: how much slower than the float model the winner must be to be warned about: a tie within the
#: timing's noise (an LSTM forecaster at 1.01x) warned in one run and not the next
SLOWER_THAN_FLOAT = 1.05

__all__ = ["BASELINE", "SLOWER_THAN_FLOAT", "float_for_timing", "warn_if_slower"]


@contextlib.contextmanager
def float_for_timing(model: Any, inputs: tuple) -> Iterator[tuple[Callable | None, str]]:
    """``model`` as it runs for inference, to be timed beside the candidates: in eval mode, every
    flag put back after (torch's exported modules, which refuse ``eval()``, as they are; an
    ``ExportedProgram`` through a fresh ``.module()``); or None, and why, if it fails on ``inputs``
    (None and '' when there is no ``model``)."""
    if model is None:
        yield None, ""
        return
    if isinstance(model, torch.export.ExportedProgram):
        model = exported_module(model)
    with contextlib.ExitStack() as stack:
        with contextlib.suppress(NotImplementedError):  # an exported module: its graph has no mode
            stack.enter_context(eval_mode(model))
        try:
            with torch.no_grad():
                model(*inputs)
        except Exception as error:  # noqa: BLE001 - a yardstick that fails must not fail auto
            yield None, f"not timed: it raised {type(error).__name__} on the example inputs: {error}"
            return
        yield model, ""


def warn_if_slower(winner: str, ratio: float, model: Any, inputs: tuple) -> None:
    """Warn once when ``winner`` (the int8 candidate chosen) took more than
    :data:`SLOWER_THAN_FLOAT` times the float model's time, with what may help for this model."""
    if not ratio > SLOWER_THAN_FLOAT:
        return
    hints = []
    if _recurrent_share(model) >= 0.5:
        hints.append('most of its weights are in LSTM/GRU layers, which static quantization leaves float: '
                     'qp.quantize_dynamic(model, backend="onnxruntime", example_inputs=...) quantizes them')
    if any(isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == 1 for x in inputs):
        hints.append("at batch 1 a small model's time goes to quantize/dequantize steps and call "
                     "overhead: time it at a larger batch, where int8 may pay off")
    if not hints:
        hints.append("the layers left float and the quantize/dequantize steps around small int8 "
                     "regions may cost more than int8 saves (qp.quantization_report lists them)")
    warn_user(f"qplug: backend='auto': the int8 backend chosen ({winner}) runs this model at "
              f"{ratio:.2f}x the float model's time on these inputs; {'; '.join(hints)}. The int8 "
              "model is returned as asked (qp.quantization_report(model).auto lists the times)")


def _recurrent_share(model: Any) -> float:
    """The share of ``model``'s parameters held by LSTM/GRU/RNN layers (0 for a program)."""
    if not isinstance(model, nn.Module):
        return 0.0
    total = sum(p.numel() for p in model.parameters())
    recurrent = sum(p.numel() for m in model.modules() if isinstance(m, _RECURRENT) for p in m.parameters())
    return recurrent / total if total else 0.0
