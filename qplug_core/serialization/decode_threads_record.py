"""The decode-step thread choices of a saved weight-only or W8A8 model, as data in its file.

A decoder's one-token steps run on the thread count measured faster
(:mod:`qplug_core.weight_only.decode_step`); without a record every process loading the file timed
its first steps again, each replica choosing on its own. The record lists each choice made:
(thread count, batch size, whether one thread runs it); ``qp.load`` starts from it
(``reselect=True`` measures again). Thread counts do not change outputs, only speed.
"""

from __future__ import annotations

from typing import Any

from qplug_core.config.codec import child, expect, read_fields, where
from qplug_core.errors import ConfigError

KEY = "decode_threads"
_FIELDS = ("threads", "batch", "single")
#: more (thread count, batch) pairs than any model meets
_MAX_CHOICES = 4096


def to_document(recorded: list[tuple[int, int, bool]]) -> list[dict[str, Any]]:
    return [{"threads": threads, "batch": batch, "single": single} for threads, batch, single in recorded]


def from_document(doc: Any, path: str) -> list[tuple[int, int, bool]]:
    """The checked record; raises :class:`ConfigError` naming the bad field."""
    entries = expect(doc, list, path, "a JSON list")
    if len(entries) > _MAX_CHOICES:
        raise ConfigError(f"{where(path)}: {len(entries)} choices, more than {_MAX_CHOICES}", field=path,
                          value=len(entries))
    recorded = []
    for i, entry in enumerate(entries):
        at = child(path, i)
        read_fields(entry, at, _FIELDS, required=_FIELDS)
        threads = expect(entry["threads"], int, child(at, "threads"), "a thread count")
        batch = expect(entry["batch"], int, child(at, "batch"), "a batch size")
        if threads < 2 or batch < 1:
            raise ConfigError(f"{where(at)}: {threads} threads at batch {batch} is not a choice qplug makes "
                              "(2 threads or more, batch 1 or more)", field=at, value=entry)
        recorded.append((threads, batch, expect(entry["single"], bool, child(at, "single"), "true or false")))
    return recorded
