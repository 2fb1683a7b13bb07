"""``qplug quantize MODULE:FACTORY``: quantize a user's model from the shell and save it.

The model comes from a factory function (importable from the current directory) rather than a
pickled file, so nothing is unpickled; calibration data is read from .safetensors or .npy.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any

import typer

from qplug_core.commands._common import parse_shape


class Mode(str, Enum):
    static = "static"
    dynamic = "dynamic"
    qat_convert = "qat-convert"


class Capture(str, Enum):
    auto = "auto"
    symbolic = "symbolic"
    export = "export"


def quantize_model(model: Any, example: tuple, calibration: Path | None, backend: str | None,
                   mode: Mode, capture: Capture = Capture.auto) -> Any:
    """The converted model for ``mode``; ``qat-convert`` expects a ``qp.prepare_qat_fx`` model."""
    from torch import fx

    import qplug_core as qp
    from qplug_core.commands._inputs import load_calibration, random_calibration
    from qplug_core.errors import ConfigError
    from qplug_core.flows import resolve_backend

    chosen = resolve_backend(backend).require_available()
    if mode is Mode.qat_convert:
        if not isinstance(model, fx.GraphModule):
            raise ConfigError(f"--mode qat-convert needs the trained model qp.prepare_qat_fx returned; "
                              f"the factory returned a plain {type(model).__name__}, which was not "
                              "prepared by qplug (use --mode static for a float model)", field="mode")
        return qp.convert_fx(model.eval(), backend=chosen)
    if mode is Mode.dynamic:  # weights only ahead of time: no calibration data needed
        mapping = qp.get_default_qconfig_mapping(chosen, "dynamic")
        return qp.convert_fx(qp.prepare_fx(model, mapping, example, backend=chosen,
                                           capture=capture.value), backend=chosen)
    shape = tuple(example[0].shape)
    batches = load_calibration(calibration, shape) if calibration else random_calibration(shape)
    return qp.quantize(model, example, batches, backend=chosen, capture=capture.value)


def quantize(
    model_spec: str = typer.Argument(..., metavar="MODULE:FACTORY",
                                     help="A function returning the float nn.Module."),
    example_shape: str = typer.Option(..., "--example-shape", help="Input shape, e.g. 1,3,224,224."),
    out: Path = typer.Option(..., "--out", help="Where to write the int8 model (.safetensors)."),
    calibration: Path = typer.Option(None, "--calibration",
                                     help=".safetensors (one tensor per batch) or .npy file."),
    backend: str = typer.Option(None, "--backend", help="Backend (default: the best one here)."),
    mode: Mode = typer.Option(Mode.static, "--mode", help="static, dynamic, or qat-convert (the "
                                                          "factory returns a trained QAT model)."),
    capture: Capture = typer.Option(Capture.auto, "--capture",
                                    help="auto (symbolic tracing when the model traces, else "
                                         "torch.export), symbolic, or export."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document (schema_version 1)."),
) -> None:
    """Quantize MODULE:FACTORY's model, save it with qp.save and print the quantization report."""
    import torch

    import qplug_core as qp
    from qplug_core.commands._inputs import load_factory_model
    from qplug_core.commands._report import print_report

    shape = parse_shape(example_shape)
    model = load_factory_model(model_spec)
    qmodel = quantize_model(model, (torch.randn(shape),), calibration, backend, mode, capture)
    path = qp.save(qmodel, out)
    report = qp.quantization_report(qmodel)
    print_report(report, {"model": model_spec, "mode": mode.value, "backend": report.backend,
                          "capture": report.capture, "out": str(path),
                          "size_bytes": path.stat().st_size}, as_json)


def register(app: typer.Typer) -> None:
    app.command("quantize")(quantize)
