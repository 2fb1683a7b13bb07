"""Running calibration batches through a float graph while hooks record what a pass needs."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from qplug_core.errors import CalibrationError, QplugError
from qplug_core.observers.tokens import batch_token_mask, observing_tokens


def run_hooked(gm: fx.GraphModule, calibration_data: Any, handles: list, what: str) -> int:
    """Run every batch through ``gm`` (no gradients), then remove ``handles``; the batch count.

    No batch at all is a :class:`CalibrationError` naming ``what`` needed them.
    """
    from qplug_core.flows.steps import batch_does_not_fit, iter_batches

    batches = 0
    try:
        with torch.no_grad():
            for batch in iter_batches(calibration_data):
                with observing_tokens(batch_token_mask(gm, batch)):  # as calibrate does
                    try:
                        gm(*batch)
                    except QplugError:
                        raise
                    except Exception as error:  # the batch, not the pass: say so as calibrate does
                        raise batch_does_not_fit(batches, error) from error
                batches += 1
    finally:
        for handle in handles:
            handle.remove()
    if batches == 0:
        raise CalibrationError(f"{what} got 0 calibration batches; pass the data calibration "
                               "will use")
    return batches
