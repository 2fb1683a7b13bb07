"""``qplug report PATH``: what a saved int8 model contains, and what it was made with.

``--sensitivity MODULE:FACTORY --example-shape ...`` also ranks the float model's layers by the
output error each causes when int8, on the saved model's backend (see ``qp.sensitivity``).
"""

from __future__ import annotations

import json
from pathlib import Path

import typer


def report(
    path: Path = typer.Argument(..., help="A model written by qp.save / qplug quantize."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document (schema_version 1)."),
    sensitivity_of: str = typer.Option(
        None, "--sensitivity", metavar="MODULE:FACTORY",
        help="Also rank this float model's layers by the output error each causes when int8."),
    example_shape: str = typer.Option(None, "--example-shape",
                                      help="Input shape for --sensitivity, e.g. 1,3,224,224."),
    calibration: Path = typer.Option(None, "--calibration",
                                     help="Calibration batches for --sensitivity (.safetensors/.npy)."),
) -> None:
    """Show a saved model's backend, versions, int8 regions, kernels, float ops and size."""
    import qplug_core as qp
    from qplug_core.commands._common import emit_json, show
    from qplug_core.commands._report import print_report
    from qplug_core.errors import ConfigError
    from qplug_core.serialization.files import read_artifact_file

    qmodel = qp.load(path)
    document = json.loads(read_artifact_file(path)[0])  # what it was saved with, not what runs now
    facts = {"path": str(path), "size_bytes": path.stat().st_size, "backend": document["backend"],
             "saved_with": {**document["versions"],
                            **{p["dist"] or p["name"]: p["version"] for p in document["plugins"]}}}
    ranking = None
    if sensitivity_of is not None:
        if example_shape is None:
            raise ConfigError("--sensitivity needs --example-shape", field="example_shape")
        ranking = _sensitivity(sensitivity_of, example_shape, calibration, document["backend"])
    if as_json and ranking is not None:
        emit_json({**facts, "report": qp.quantization_report(qmodel).to_dict(),
                   "sensitivity": ranking.to_dict()})
        return
    print_report(qp.quantization_report(qmodel), facts, as_json)
    if ranking is not None:
        show(ranking)


def _sensitivity(model_spec: str, example_shape: str, calibration: Path | None, backend: str):
    import torch

    import qplug_core as qp
    from qplug_core.commands._common import parse_shape
    from qplug_core.commands._inputs import (
        load_calibration,
        load_factory_model,
        random_calibration,
    )

    shape = parse_shape(example_shape)
    batches = load_calibration(calibration, shape) if calibration else random_calibration(shape)
    return qp.sensitivity(load_factory_model(model_spec), (torch.randn(shape),), batches,
                          backend=backend)


def register(app: typer.Typer) -> None:
    app.command("report")(report)
