"""The image sizes ``qp.quantize`` calibrates with, for the export capture to keep dynamic.

An export capture fixes an image's height and width to the example's (symbolic ones cost a
vision transformer's capture 10-15x): a detector calibrated at 320x320 and 256x384 then refused
256x384. Calibration data holding several sizes says the user serves them, so the capture tries
them dynamic (:func:`qplug_core.ir.capture.export_images_dynamic`). The batches are set here by
``qp.quantize``, which holds the calibration data, for the capture deep in ``prepare_fx``, which
does not.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator
from typing import Any

from qplug_core.ir.capture import is_image

__all__ = ["calibrated_sizes", "image_sizes", "sizes_seen"]

_SEEN: contextvars.ContextVar[tuple[tuple[Any, ...], ...]] = contextvars.ContextVar("image_sizes_seen", default=())


def image_sizes(inputs: tuple[Any, ...]) -> tuple[tuple[int, ...], ...]:
    """The sizes after batch and channels of each image input (``()`` for a model without one)."""
    return tuple(tuple(value.shape[2:]) for value in inputs if is_image(value))


@contextlib.contextmanager
def calibrated_sizes(batches: Iterable[tuple[Any, ...]]) -> Iterator[None]:
    """Within: :func:`sizes_seen` gives one of ``batches`` per distinct image size."""
    distinct: dict[tuple[tuple[int, ...], ...], tuple[Any, ...]] = {}
    for batch in batches:
        sizes = image_sizes(batch)
        if sizes:
            distinct.setdefault(sizes, batch)
    token = _SEEN.set(tuple(distinct.values()))
    try:
        yield
    finally:
        _SEEN.reset(token)


def sizes_seen() -> tuple[tuple[Any, ...], ...]:
    """One calibration batch per image size ``qp.quantize`` is calibrating with (none outside it)."""
    return _SEEN.get()
