"""``qplug report PATH``: what a saved int8 model contains, and what it was made with."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def report(
    path: Path = typer.Argument(..., help="A model written by qp.save / qplug quantize."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document (schema_version 1)."),
) -> None:
    """Show a saved model's backend, versions, int8 regions, kernels, float ops and size."""
    import qplug_core as qp
    from qplug_core.commands._report import print_report
    from qplug_core.serialization.files import read_artifact_file

    qmodel = qp.load(path)
    document = json.loads(read_artifact_file(path)[0])  # what it was saved with, not what runs now
    print_report(qp.quantization_report(qmodel), {
        "path": str(path), "size_bytes": path.stat().st_size, "backend": document["backend"],
        "saved_with": {**document["versions"],
                       **{p["dist"] or p["name"]: p["version"] for p in document["plugins"]}},
    }, as_json)


def register(app: typer.Typer) -> None:
    app.command("report")(report)
