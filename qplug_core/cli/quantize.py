"""``qplug quantize MODULE:FACTORY``: quantize a user's model from the shell and save it.

The model comes from a factory function (importable from the current directory) rather than a
pickled file, so nothing is unpickled; calibration data is read from .safetensors or .npy. Models
with several inputs, or integer ones (token ids, masks), take one ``--example-shape`` and
``--example-dtype`` per input and a .safetensors file keyed ``NAME/INDEX``.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any

import typer

from qplug_core.registry.isolation import stdout_to_stderr


class QuantizeMode(str, Enum):
    """`qplug quantize --mode` (not :class:`qplug_core.enums.Mode`, the qconfig modes)."""

    static = "static"
    dynamic = "dynamic"
    qat_convert = "qat-convert"
    w8a8 = "w8a8"
    weight_only = "weight-only"


#: the modes that swap modules in the user's own model (it keeps its class and generate())
SWAP_MODES = (QuantizeMode.w8a8, QuantizeMode.weight_only)


class Capture(str, Enum):
    auto = "auto"
    symbolic = "symbolic"
    export = "export"


#: options shared by the commands that build example inputs (quantize, bench)
EXAMPLE_SHAPES = typer.Option(..., "--example-shape",
                              help="Shape of one input, batch first, e.g. 1,3,224,224; repeat it "
                                   "once per positional input of forward.")
EXAMPLE_DTYPES = typer.Option([], "--example-dtype",
                              help="dtype of each input (float32, int64, ...): once for all "
                                   "inputs, or once per --example-shape. Default float32.")


def quantize_model(model: Any, example: tuple, calibration: list[tuple] | None, backend: Any,
                   mode: QuantizeMode, capture: Capture = Capture.auto, bits: int = 8,
                   group_size: int | None = None) -> Any:
    """The converted model for ``mode``; ``qat-convert`` expects a ``qp.prepare_qat_fx`` model."""
    from torch import fx

    import qplug_core as qp
    from qplug_core.errors import ConfigError
    from qplug_core.flows.capture import generates
    from qplug_core.observers import distributed

    if mode is QuantizeMode.qat_convert:
        if not isinstance(model, fx.GraphModule):
            raise ConfigError(f"--mode qat-convert needs the trained model qp.prepare_qat_fx returned; "
                              f"the factory returned a plain {type(model).__name__}, which was not "
                              "prepared by qplug (use --mode static for a float model)", field="--mode")
        return qp.convert_fx(model.eval(), backend=backend)
    if mode is QuantizeMode.dynamic:  # weights only ahead of time: no calibration data needed
        if capture is Capture.auto and generates(model) and backend.kernels:
            # as qp.quantize_dynamic does: its linears swapped, so it keeps its class and generate()
            # (an encoder-decoder does not trace whole)
            return qp.quantize_dynamic(model, backend=backend)
        mapping = qp.get_default_qconfig_mapping(backend, "dynamic")
        return qp.convert_fx(qp.prepare_fx(model, mapping, example, backend=backend,
                                           capture=capture.value), backend=backend)
    if mode is QuantizeMode.w8a8:  # the backends' kernels are picked per layer for this CPU
        return qp.quantize_w8a8(model, calibration)
    if mode is QuantizeMode.weight_only:
        return qp.quantize_weights(model, bits=bits, group_size=group_size)
    if capture is Capture.auto and generates(model):  # the file holds a graph: say what that costs
        capture = Capture.export
    # under torchrun each rank calibrates on its shard; the observers then agree across ranks
    return qp.quantize(model, example, distributed.shard_by_rank(calibration), backend=backend,
                       capture=capture.value)


def quantize(
    model_spec: str = typer.Argument(..., metavar="MODULE:FACTORY",
                                     help="A function returning the float nn.Module."),
    example_shapes: list[str] = EXAMPLE_SHAPES,
    example_dtypes: list[str] = EXAMPLE_DTYPES,
    out: Path = typer.Option(..., "--out", help="Where to write the int8 model (.safetensors)."),
    calibration: Path = typer.Option(None, "--calibration",
                                     help=".safetensors (one tensor per batch, or NAME/INDEX keys "
                                          "for several inputs) or .npy file (one batch)."),
    evaluation: Path = typer.Option(None, "--eval",
                                    help="Held-out inputs (same format as --calibration) to measure "
                                         "accuracy on; default: the calibration batches."),
    backend: str = typer.Option(None, "--backend", help="Backend (default: the best one here; "
                                                        "auto: the fastest measured, static only)."),
    mode: QuantizeMode = typer.Option(QuantizeMode.static, "--mode", help="static, dynamic, qat-convert (the factory "
                                                          "returns a trained QAT model), or, keeping the "
                                                          "model's own class and generate(): w8a8 "
                                                          "(SmoothQuant, int8 weights and per-token "
                                                          "activations) or weight-only."),
    bits: int = typer.Option(8, "--bits", help="Weight bits for --mode weight-only: 8 or 4."),
    group_size: int = typer.Option(None, "--group-size", help="Weights per scale for --mode weight-only "
                                                              "(e.g. 32, 128); default one per channel."),
    capture: Capture = typer.Option(Capture.auto, "--capture",
                                    help="auto (symbolic tracing when the model traces, else "
                                         "torch.export), symbolic, or export."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document (schema_version 1)."),
    verbose: bool = typer.Option(False, "--verbose", help="List every op left in float, shape and "
                                                          "integer ops too."),
) -> None:
    """Quantize MODULE:FACTORY's model, save it with qp.save, print the report and its accuracy."""
    import qplug_core as qp
    from qplug_core.cli._accuracy import accuracy_document
    from qplug_core.cli._common import UsageError
    from qplug_core.cli._inputs import (
        EVAL,
        forward_input_names,
        input_specs,
        load_batches,
        load_factory_model,
        random_calibration,
    )
    from qplug_core.cli._report import print_report
    from qplug_core.flows.auto import AUTO
    from qplug_core.flows.steps import resolve_backend
    from qplug_core.observers import distributed

    specs = input_specs(example_shapes, example_dtypes)
    if mode in SWAP_MODES and backend is not None:
        raise UsageError(f"--mode {mode.value} picks the fastest kernels installed for each layer "
                         "itself; leave out --backend", field="--backend", value=backend)
    if backend == AUTO and mode is not QuantizeMode.static:
        raise UsageError(f"--backend auto measures static int8 models only, not --mode "
                         f"{mode.value}; name a backend", field="--backend", value=backend)
    check_writable(out)  # before minutes of quantizing, not after
    with stdout_to_stderr():  # stdout is for the report: what the user's code prints goes to stderr
        model = load_factory_model(model_spec)
        names = forward_input_names(model, len(specs))
        chosen = (None if mode in SWAP_MODES else backend if backend == AUTO
                  else resolve_backend(backend).require_available())
        batches = (load_batches(calibration, specs, names) if calibration
                   else random_calibration(specs) if mode in (QuantizeMode.static, QuantizeMode.w8a8) else None)
        held_out = load_batches(evaluation, specs, names, what=EVAL) if evaluation else None  # before the work
        example = _example(specs, batches if calibration else None)
        with distributed.process_group_from_env():  # under torchrun: calibrate on this rank's shard
            qmodel = quantize_model(model, example, batches, chosen, mode, capture, bits, group_size)
            if chosen == AUTO:  # what it chose, for the accuracy comparison
                chosen = qp.get_backend(qp.quantization_report(qmodel).backend)
            saving = distributed.is_rank_zero()
        if not saving:  # rank 0 saves and reports for all
            return
        path = qp.save(qmodel, out)
    evaluated_on = (f"--eval {evaluation}" if evaluation else
                    f"the calibration set {calibration} (not held out)" if calibration
                    else "random inputs (pass --eval FILE for a real figure)")
    if mode in SWAP_MODES:
        _report_swapped(model_spec, model, qmodel, path, held_out or batches or [example], evaluated_on,
                        as_json)
        return
    report = qp.quantization_report(qmodel)
    facts: dict[str, Any] = {"model": model_spec, "mode": mode.value, "backend": report.backend,
                             "capture": report.capture, "out": str(path),
                             "size_bytes": path.stat().st_size}
    if mode is not QuantizeMode.qat_convert:  # a QAT factory returns no float original to compare with
        with stdout_to_stderr():  # the comparison runs the user's model again
            facts["accuracy"] = accuracy_document(
                model, qmodel, held_out or batches or [example], backend=chosen, evaluated_on=evaluated_on,
                fuse=mode is QuantizeMode.static or bool(report.fusions))  # the dynamic flow fuses linear+relu too
    print_report(report, facts, as_json, verbose)


def _report_swapped(model_spec: str, model: Any, qmodel: Any, path: Path, batches: list, evaluated_on: str,
                    as_json: bool) -> None:
    """What a module-swap model holds (read back from its file) and how close it answers to float."""
    from qplug_core.cli._accuracy import accuracy_document
    from qplug_core.cli._report import print_swapped
    from qplug_core.cli._saved import compared_layers, saved_document
    from qplug_core.serialization.weight_only import swapped_facts

    document = saved_document(path)
    facts: dict[str, Any] = {"model": model_spec, **swapped_facts(document), "out": str(path),
                             "size_bytes": path.stat().st_size}
    with stdout_to_stderr():  # the comparison runs the user's model again
        facts["accuracy"] = accuracy_document(model, qmodel, batches, backend=None, fuse=False,
                                              layers=compared_layers(document), evaluated_on=evaluated_on)
    print_swapped(facts, as_json)


def check_writable(out: Path) -> None:
    """A ``--out`` whose folder does not exist (or is a file) is an error before any work."""
    from qplug_core.errors import ConfigError

    folder = out.parent if str(out.parent) else Path(".")
    if not folder.is_dir():
        raise ConfigError(f"--out {out}: the folder {folder} does not exist; create it first or "
                          "choose another path", field="--out", value=str(out))
    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder; give a file path such as {out / 'model.safetensors'}",
                          field="--out", value=str(out))


def register(app: typer.Typer) -> None:
    app.command("quantize")(quantize)


def _example(specs: list, batches: list | None) -> tuple:
    """The example inputs: the calibration file's first batch where it has the ``--example-shape``
    shapes (ones are no valid offsets or lengths), else tensors of those shapes. A batch of other
    shapes is not used: the example's shapes are recorded in the file, and under torchrun each
    rank's first batch is its own (the ranks and one process must save the same model)."""
    example = tuple(spec.example() for spec in specs)
    first = batches[0] if batches else None
    if first is not None and len(first) == len(example) and all(
            getattr(b, "shape", None) == e.shape and getattr(b, "dtype", None) == e.dtype
            for b, e in zip(first, example)):
        return tuple(first)
    return example
