"""A saved graph model's report from its file's header alone, for ``qplug report``.

Describing a file loaded it: every tensor read, hashed and lowered to kernels, to print what the
header already says. The header holds the graph with its region tags, the modules and the lowering
convert recorded (kernel or partition per int8 anchor, why the rest stayed in reference form), so
the report is built from it with the reference form rebuilt on the meta device: no tensor is read
and no kernel packed. What only a load knows (a delegating backend's partitions, the notes lowering
adds) is left to ``qplug report --verify``, which loads the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qplug_core.config.codec import decode_dtype
from qplug_core.errors import ConfigError, QplugError, SerializationError
from qplug_core.flows.delegate import DelegationSummary
from qplug_core.flows.finish import conversion_report, float_outputs, quantized_regions
from qplug_core.flows.report import QuantizationReport, pattern_op_keys
from qplug_core.flows.tags import FUSIONS
from qplug_core.flows.target_rungs import name_rungs
from qplug_core.flows.work_share import work_by_name
from qplug_core.registry.backends import get_backend
from qplug_core.serialization import check_record, format_features
from qplug_core.serialization.api import rebuild_graph
from qplug_core.serialization.artifact import TARGET_RUNGS_KEY, from_document, fusion_records, lowering_of

#: what the report of a file described from its header says it leaves out
HEADER_ONLY = ("described from the file's header (no tensor read, no kernel built): qplug report --verify "
               "loads the file, checks its digest and lists what only a load knows (a delegating backend's "
               "partitions, notes from lowering)")


def describe_saved(path: Path, document: dict[str, Any]) -> QuantizationReport:
    """The report of the graph model whose file's document is ``document``, as loading it on its
    backend would give (the lowering as recorded at convert)."""
    document, _ = format_features.accept(document, {}, path)
    try:
        tensors = {key: torch.empty(entry["shape"], dtype=decode_dtype(entry["dtype"], field=key), device="meta")
                   for key, entry in document["model"]["tensors"].items()}
        artifact = from_document(document, tensors)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError, ConfigError) as exc:
        raise SerializationError(f"{path} is not a valid qplug artifact: {type(exc).__name__}: {exc}",
                                 path=str(path)) from exc
    gm = rebuild_graph(artifact, path)
    gm.meta[FUSIONS] = fusion_records(artifact)
    record = lowering_of(artifact)
    kernels = {} if record is None else record.kernels
    report = conversion_report(gm, artifact.backend, artifact.model["mode"], quantized_regions(gm), kernels,
                               {} if record is None else record.reference,
                               DelegationSummary(kept_regions={} if record is None else record.regions),
                               _pattern_ops(artifact.backend), float_outputs(gm), work_by_name(gm))
    name_rungs(report, artifact.model.get(TARGET_RUNGS_KEY, {}))
    report.final_check = dict(artifact.model.get(check_record.KEY, {}))
    report.notes.append(HEADER_ONLY if record is not None else
                        f"{HEADER_ONLY}; this file records no lowering (written by an older qplug), so its "
                        "kernels are not listed")
    return report


def _pattern_ops(backend: str) -> frozenset[str]:
    """What the file's backend's patterns name, as the load's report reads them; none when that
    backend is not installed (an ATen op no pattern matched then reads "no pattern matches")."""
    try:
        return pattern_op_keys(get_backend(backend).config)
    except QplugError:
        return frozenset()
