"""``qplug report PATH``: what a saved int8 model contains, what it was made with, and (given the
float model and inputs) how close it answers to float."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def report(
    path: Path = typer.Argument(..., help="A model written by qp.save / qplug quantize."),
    float_spec: str = typer.Option(None, "--float", metavar="MODULE:FACTORY",
                                   help="The float model it was made from, to measure accuracy."),
    evaluation: Path = typer.Option(None, "--eval",
                                    help="Inputs to measure accuracy on (.safetensors or .npy, as "
                                         "for qplug quantize --calibration); needs --float."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document (schema_version 1)."),
) -> None:
    """Show a saved model's backend, versions, int8 regions, kernels, float ops and size."""
    import qplug_core as qp
    from qplug_core.commands._report import print_report
    from qplug_core.errors import ConfigError
    from qplug_core.serialization.files import read_artifact_file

    if (float_spec is None) != (evaluation is None):
        raise ConfigError("--float and --eval go together: the float model and the inputs to "
                          "compare it with the int8 model on", field="--float" if float_spec is None
                          else "--eval")
    qmodel = qp.load(path)
    document = json.loads(read_artifact_file(path)[0])  # what it was saved with, not what runs now
    facts = {
        "path": str(path), "size_bytes": path.stat().st_size, "backend": document["backend"],
        "saved_with": {**document["versions"],
                       **{p["dist"] or p["name"]: p["version"] for p in document["plugins"]}},
    }
    if float_spec is not None and evaluation is not None:
        from qplug_core.commands._accuracy import accuracy_document
        from qplug_core.commands._inputs import forward_input_names, input_count, load_batches
        from qplug_core.commands._inputs import load_factory_model

        model = load_factory_model(float_spec)
        names = forward_input_names(model, input_count(evaluation))
        facts["accuracy"] = accuracy_document(
            model, qmodel, load_batches(evaluation, None, names, what="--eval"), backend=document["backend"],
            evaluated_on=f"--eval {evaluation}",
            fuse=qp.quantization_report(qmodel).mode != "dynamic")
    print_report(qp.quantization_report(qmodel), facts, as_json)


def register(app: typer.Typer) -> None:
    app.command("report")(report)
