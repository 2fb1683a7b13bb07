"""``qplug report PATH``: what a saved int8 model contains, what it was made with, and (given the
float model and inputs) how close it answers to float.

``--sensitivity MODULE:FACTORY --example-shape ...`` also ranks the float model's layers by the
output error each causes when int8, on the saved model's backend (see ``qp.sensitivity``).
"""

from __future__ import annotations

from pathlib import Path

import typer

from qplug_core.cli.quantize import EXAMPLE_DTYPES


def report(
    path: Path = typer.Argument(..., help="A model written by qp.save / qplug quantize."),
    float_spec: str = typer.Option(None, "--float", metavar="MODULE:FACTORY",
                                   help="The float model it was made from, to measure accuracy."),
    evaluation: Path = typer.Option(None, "--eval",
                                    help="Inputs to measure accuracy on (.safetensors or .npy, as "
                                         "for qplug quantize --calibration); needs --float."),
    sensitivity_of: str = typer.Option(
        None, "--sensitivity", metavar="MODULE:FACTORY",
        help="Also rank this float model's layers by the output error each causes when int8."),
    example_shapes: list[str] = typer.Option([], "--example-shape",
                                             help="Input shape(s) for --sensitivity, as for "
                                                  "qplug quantize."),
    example_dtypes: list[str] = EXAMPLE_DTYPES,
    calibration: Path = typer.Option(None, "--calibration",
                                     help="Calibration batches for --sensitivity (.safetensors/.npy)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document (schema_version 1)."),
    verbose: bool = typer.Option(False, "--verbose", help="List every op left in float, shape and "
                                                          "integer ops too."),
    verify: bool = typer.Option(False, "--verify", help="Check the file's digest first (one pass over "
                                                        "the file) and load the model (a graph model "
                                                        "is otherwise described from its header)."),
) -> None:
    """Show a saved model's backend, versions, int8 regions, kernels, float ops and size, read from
    the file's header (--verify and --float load it: from its reference form where its backend is
    not installed)."""
    import qplug_core as qp
    from qplug_core.cli._common import UsageError, emit_json
    from qplug_core.cli._report import print_report
    from qplug_core.cli._saved import saved_document
    from qplug_core.cli._table import show
    from qplug_core.errors import BackendNotFoundError
    from qplug_core.serialization.described import describe_saved
    from qplug_core.serialization.weight_only import is_swapped_document

    if (float_spec is None) != (evaluation is None):
        raise UsageError("--float and --eval go together: the float model and the inputs to "
                          "compare it with the int8 model on", field="--float" if float_spec is None
                          else "--eval")
    if sensitivity_of is not None and not example_shapes:
        raise UsageError("--sensitivity needs --example-shape", field="--example-shape")
    document = saved_document(path, verify=verify)  # what it was saved with, not what runs now
    if is_swapped_document(document):
        _report_swapped(path, document, float_spec, evaluation, sensitivity_of, as_json)
        return
    qmodel, described_from = None, None
    if verify or float_spec is not None:  # the model itself: loaded, checked, lowered
        try:
            qmodel = qp.load(path)
        except BackendNotFoundError as error:  # a support ticket's machine rarely has the vendor's plugin
            qmodel = qp.load(path, backend="reference")
            described_from = f"its reference form, not its backend's kernels ({error})"
    report = qp.quantization_report(qmodel) if qmodel is not None else describe_saved(path, document)
    facts = {
        "path": str(path), "size_bytes": path.stat().st_size, "backend": document["backend"],
        "saved_with": {**document["versions"],
                       **{p["dist"] or p["name"]: p["version"] for p in document["plugins"]}},
    }
    if described_from is not None:
        facts["described_from"] = described_from
    if float_spec is not None and evaluation is not None:
        facts["accuracy"] = _accuracy(qmodel, float_spec, evaluation, document["backend"])
    ranking = None
    if sensitivity_of is not None:
        ranking = _sensitivity(sensitivity_of, example_shapes, example_dtypes, calibration,
                               document["backend"])
    if as_json and ranking is not None:
        emit_json({**facts, "report": report.to_dict(), "sensitivity": ranking.to_dict()})
        return
    print_report(report, facts, as_json, verbose)
    if ranking is not None:
        show(ranking)


def _report_swapped(path: Path, document: dict, float_spec: str | None, evaluation: Path | None,
                    sensitivity_of: str | None, as_json: bool) -> None:
    """A module-swap file: what it holds, read from the file; accuracy after loading it into
    ``--float``'s model."""
    from qplug_core.cli._report import print_swapped
    from qplug_core.cli._saved import compared_layers, load_saved
    from qplug_core.errors import ConfigError
    from qplug_core.serialization.weight_only import swap_mode, swapped_facts

    if sensitivity_of is not None:
        raise ConfigError(f"--sensitivity ranks layers for static int8 graphs; {path} holds a "
                          f"{swap_mode(document)} model", field="--sensitivity")
    facts = {"path": str(path), "size_bytes": path.stat().st_size, **swapped_facts(document)}
    if float_spec is not None and evaluation is not None:
        qmodel = load_saved(path, float_spec, command="report")
        facts["accuracy"] = _accuracy(qmodel, float_spec, evaluation, None, layers=compared_layers(document))
    print_swapped(facts, as_json)


def _accuracy(qmodel, float_spec: str, evaluation: Path, backend: str | None,
              layers: set[str] | None = None) -> dict:
    import qplug_core as qp
    from qplug_core.cli._accuracy import accuracy_document
    from qplug_core.cli._inputs import (
        EVAL,
        forward_input_names,
        input_count,
        load_batches,
        load_factory_model,
    )

    model = load_factory_model(float_spec)
    names = forward_input_names(model, input_count(evaluation))
    swapped = layers is not None  # a module-swap model: its layers are the float model's, unfused
    return accuracy_document(model, qmodel, load_batches(evaluation, None, names, what=EVAL),
                             backend=backend, evaluated_on=f"--eval {evaluation}",
                             fuse=not swapped and _fused(qp.quantization_report(qmodel)), layers=layers)


def _fused(report) -> bool:
    """Whether layers compare against the fused float model: static, or a dynamic graph that fused
    (linear+relu), whose layer runs the pair; module-swap dynamic models fuse nothing."""
    return report.mode != "dynamic" or bool(report.fusions)


def _sensitivity(model_spec: str, shapes: list[str], dtypes: list[str], calibration: Path | None,
                 backend: str):
    import qplug_core as qp
    from qplug_core.cli._inputs import (
        forward_input_names,
        input_specs,
        load_batches,
        load_factory_model,
        random_calibration,
    )

    specs = input_specs(shapes, dtypes)
    model = load_factory_model(model_spec)
    batches = (load_batches(calibration, specs, forward_input_names(model, len(specs)))
               if calibration else random_calibration(specs))
    example = tuple(spec.example() for spec in specs)
    return qp.sensitivity(model, example, batches, backend=backend)


def register(app: typer.Typer) -> None:
    app.command("report")(report)
