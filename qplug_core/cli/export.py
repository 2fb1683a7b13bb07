"""``qplug export FILE OUT.onnx``: a saved int8 model as an ONNX QDQ model."""

from __future__ import annotations

from pathlib import Path

import typer


def export(
    path: Path = typer.Argument(..., help="A model written by qp.save / qplug quantize."),
    out: Path = typer.Argument(..., help="Where to write the .onnx file."),
    opset: int = typer.Option(21, help="ONNX opset to target (13 or newer)."),
    dynamic_batch: bool = typer.Option(False, "--dynamic-batch",
                                       help="Axis 0 of every input is the symbolic dimension 'batch'."),
    dynamic_sequence: bool = typer.Option(False, "--dynamic-sequence",
                                          help="Axis 1 of every input of rank >= 2 is 'sequence' "
                                               "(token models)."),
    dynamic_axis: list[str] = typer.Option([], "--dynamic-axis", metavar="AXIS=NAME",
                                           help="Axis AXIS of every input of higher rank is the symbolic "
                                                "dimension NAME (repeatable), e.g. --dynamic-axis 2=time for "
                                                "(batch, channels, time) inputs."),
) -> None:
    """Write a saved model's reference form as ONNX QDQ (QuantizeLinear/DequantizeLinear)."""
    import qplug_core as qp
    from qplug_core.cli._saved import saved_document
    from qplug_core.errors import ExportError
    from qplug_core.serialization.weight_only import is_swapped_document, swap_mode

    named = dict(_axis(text) for text in dynamic_axis)
    document = saved_document(path)
    if is_swapped_document(document):
        raise ExportError(f"{path} holds a {swap_mode(document)} model (quantized by module swap); qplug export "
                          "writes converted graph models (qplug quantize --mode static or dynamic) as ONNX QDQ")
    qmodel = qp.load(path, backend="reference")
    written = qp.export_onnx(qmodel, out, opset=opset, dynamic_batch=dynamic_batch,
                             dynamic_sequence=dynamic_sequence, dynamic_axes=named or None)
    typer.echo(f"wrote {written} ({written.stat().st_size} bytes)")


def _axis(text: str) -> tuple[int, str]:
    """``2=time`` -> ``(2, "time")``; anything else is a usage error."""
    axis, _, name = text.partition("=")
    if not axis.strip().isdigit() or not name.strip():
        raise typer.BadParameter(f"{text!r} is not AXIS=NAME (e.g. 2=time)", param_hint="--dynamic-axis")
    return int(axis), name.strip()


def register(app: typer.Typer) -> None:
    app.command("export")(export)
