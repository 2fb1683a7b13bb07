"""The digest ``qp.save`` stores in a file and ``qp.load`` checks: damage is an error, not new answers.

safetensors checks a file's structure (header, offsets, sizes) but not its bytes, and qplug's value
checks accept any finite positive scale and any int8 weight: one flipped bit in a weight, or a scale
changed to another positive value, loaded and ran with changed answers. The digest (SHA-256: twice
blake2b's speed where OpenSSL uses the CPU's SHA instructions) covers every tensor's name, dtype,
shape and bytes, in name order, and the qplug document. It is stored beside the document as one
more safetensors metadata string, ``qplug.digest``: ``sha256:`` and 64 hex digits.

It detects damage (a bad disk or copy) and edits made without writing a new digest. It is no
signature: whoever edits a file on purpose can write a new digest (or none), so what a file names
and holds is still checked as before (the name table, the values).

Compatibility rule: a file without a ``qplug.digest`` field was written before ``qp.save`` stored
digests and loads unchecked, as it did then; a field that is there must be a well-formed digest and
must match.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qplug_core.errors import SerializationError

#: safetensors metadata key of the digest (beside :data:`~qplug_core.serialization.files.METADATA_KEY`)
DIGEST_KEY = "qplug.digest"
_ALGORITHM = "sha256"
_FORM = re.compile(rf"{_ALGORITHM}:[0-9a-f]{{64}}\Z")


def digest_of(document: str, tensors: Mapping[str, torch.Tensor]) -> str:
    """``sha256:<hex>`` of ``tensors`` (contiguous, on the CPU) and ``document``."""
    layout = {name: (tensor.dtype, list(tensor.shape)) for name, tensor in tensors.items()}
    return digest_of_parts(document, layout, lambda name: [_raw_bytes(tensors[name])])


def digest_of_parts(document: str, layout: Mapping[str, tuple[torch.dtype, list[int]]],
                    chunks: Callable[[str], Iterable[Any]]) -> str:
    """``sha256:<hex>`` of tensors given by name -> (dtype, shape) and their bytes in pieces
    (``chunks(name)``: a file's tensors are hashed a block at a time, never all held at once).

    A manifest of every tensor's name, dtype and shape comes first: it fixes how many bytes each
    tensor has, so the tensors' bytes and then the document follow without separators.
    """
    names = sorted(layout)
    manifest = json.dumps([[name, str(layout[name][0]), list(layout[name][1])] for name in names],
                          separators=(",", ":")).encode()
    digest = hashlib.new(_ALGORITHM)
    digest.update(len(manifest).to_bytes(8, "little"))
    digest.update(manifest)
    for name in names:
        for chunk in chunks(name):
            digest.update(chunk)
    digest.update(document.encode())
    return f"{_ALGORITHM}:{digest.hexdigest()}"


def _raw_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's memory as bytes, without a copy: viewed as uint8 first, since numpy has no
    bfloat16 (flattened first: a 0-d tensor cannot change its element size)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def check_digest(path: Path, stored: str | None, computed: Callable[[], str]) -> None:
    """Raise :class:`SerializationError` unless the file's digest matches what was read from it,
    ``computed()`` (``stored`` None: an older file, see the compatibility rule above)."""
    if stored is None:
        return
    if not _FORM.match(stored):
        raise SerializationError(
            f"{path} is damaged or was edited: its {DIGEST_KEY} metadata field {stored[:80]!r} is not a "
            f"digest qp.save writes ({_ALGORITHM}: and 64 hex digits); copy the file again from its source, "
            "or save the model again", path=str(path))
    if stored != computed():
        raise SerializationError(
            f"{path}: the file's contents changed after it was written (damaged in transfer or on disk, or "
            f"edited): its tensors and metadata no longer match the {_ALGORITHM} digest qp.save stored in "
            "it; copy the file again from its source, or save the model again", path=str(path))
