"""What convert compiled and what it kept in reference form, recorded so that load rebuilds that.

The artifact is the reference form; a backend lowers it again at load. Left alone, that second
lowering may decide differently: a partition whose compile failed at convert (kept in reference
form, with a warning) compiles at load, a kernel refused by the kernel contract at convert (which
load cannot run: it has no example inputs) is used at load, and the loaded model answers otherwise
than the saved one did (an ``nn.MultiheadAttention`` model: 32.6 dB converted, 16.5 dB reloaded).
So the file records, per int8 anchor, the kernel or delegated partition it ran on and why the rest
stayed in reference form; load keeps the latter in reference form and refuses, naming the anchors,
when the backend now lowers the others differently. Files written before this record (no
``model.lowering``) load as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from qplug_core.config.codec import child, expect, read_fields
from qplug_core.errors import ConfigError, SerializationError

if TYPE_CHECKING:
    from pathlib import Path

    from qplug_core.flows.report import QuantizationReport

KEY = "lowering"
_FIELDS = ("kernels", "reference", "regions")
_REQUIRED = ("kernels", "reference")  # files written before "regions" have only these
#: longest anchor name or reason a file may give (a report's own are far shorter)
_MAX_TEXT = 4096


@dataclass(frozen=True)
class LoweringRecord:
    """int8 anchor -> what ran it (``kernels``), and -> why it stayed in reference form; and the
    regions a delegate's check kept out of its partitions, by end node (``regions``, a quantize
    after a float op holds no int8 anchor): load plans the partitions around the same ones."""

    kernels: dict[str, str] = field(default_factory=dict)
    reference: dict[str, str] = field(default_factory=dict)
    regions: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, report: QuantizationReport) -> LoweringRecord:
        return cls(dict(report.kernels), dict(report.reference), dict(report.kept_regions))

    def to_document(self) -> dict[str, Any]:
        document = {"kernels": dict(sorted(self.kernels.items())), "reference": dict(sorted(self.reference.items()))}
        return {**document, "regions": dict(sorted(self.regions.items()))} if self.regions else document

    @classmethod
    def from_document(cls, doc: Any, path: str, max_entries: int) -> LoweringRecord:
        """Checked: string to string maps, no more entries than the graph has nodes."""
        read_fields(doc, path, _FIELDS, required=_REQUIRED)
        maps = []
        for name in _FIELDS:
            if name not in doc:
                maps.append({})
                continue
            at = child(path, name)
            entries = expect(doc[name], dict, at, "a JSON object")
            if len(entries) > max_entries:
                raise ConfigError(f"{at}: {len(entries)} entries for a graph of {max_entries} nodes",
                                  field=at, value=len(entries))
            for key, value in entries.items():
                expect(value, str, child(at, key), "a string")
                if len(key) > _MAX_TEXT or len(value) > _MAX_TEXT:
                    raise ConfigError(f"{child(at, key)}: longer than {_MAX_TEXT} characters", field=at)
            maps.append(dict(entries))
        return cls(*maps)

    def check_rebuilt(self, report: QuantizationReport, source: Path) -> None:
        """Raise :class:`SerializationError` unless ``report`` (of the load) lowered as recorded."""
        if report.kernels == self.kernels:
            return
        lost = sorted(set(self.kernels) - set(report.kernels))
        gained = sorted(set(report.kernels) - set(self.kernels))
        moved = sorted(a for a in set(self.kernels) & set(report.kernels) if self.kernels[a] != report.kernels[a])
        parts = []
        if lost:
            why = "; ".join(f"{a}: {report.reference.get(a, 'not lowered')}" for a in lost[:3])
            parts.append(f"{len(lost)} int8 op(s) ran on backend kernels when saved but would stay in "
                         f"reference form now ({why})")
        if gained:
            parts.append(f"{len(gained)} int8 op(s) stayed in reference form when saved but would run on "
                         f"kernels now ({', '.join(gained[:3])})")
        if moved:
            parts.append(f"{len(moved)} int8 op(s) would run on other kernels ("
                         + ", ".join(f"{a}: {self.kernels[a]} -> {report.kernels[a]}" for a in moved[:3]) + ")")
        raise SerializationError(
            f"{source}: backend {report.backend!r} cannot rebuild the model as it was saved: "
            f"{'; '.join(parts)}. qp.load(path, backend='reference') gives the reference form, which "
            "runs anywhere", path=str(source))


__all__ = ["KEY", "LoweringRecord"]
