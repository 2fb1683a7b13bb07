"""``qplug bench``: float vs int8 latency of one model, timed in one interleaved run.

For a saved model (PATH) the float original is not in the file, so the baseline is its reference
form (the same int8 arithmetic simulated with float ops), and the output says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from qplug_core.commands._common import emit_json, example_tensor, parse_shape, progress, show, warn
from qplug_core.plugin_isolation import stdout_to_stderr


def _models(target: str, example: tuple, backend: str | None) -> tuple[Any, Any, str]:
    """``(baseline, int8, baseline description)`` for a saved file or a MODULE:FACTORY."""
    import qplug_core as qp

    if Path(target).is_file():
        return (qp.load(target, backend="reference"), qp.load(target, backend=backend),
                "reference form of the saved model (int8 simulated with float ops)")
    from qplug_core.commands._inputs import load_factory_model
    from qplug_core.flows import resolve_backend

    model = load_factory_model(target)
    warn("calibrating on random data: fine for timing, not for accuracy")
    qmodel = qp.quantize(model, example, [example], backend=resolve_backend(backend),
                         progress=False)
    return model, qmodel, "float model"


def bench(
    target: str = typer.Argument(..., metavar="MODULE:FACTORY|PATH",
                                 help="A model factory, or a model saved by qp.save."),
    example_shape: str = typer.Option(..., "--example-shape", help="Input shape, e.g. 1,3,224,224."),
    backend: str = typer.Option(None, "--backend", help="Backend (default: the best one here, or "
                                                        "the one a saved model was made for)."),
    runs: int = typer.Option(50, "--runs", min=3, help="Timed runs per model (interleaved)."),
    threads: int = typer.Option(1, "--threads", min=1, help="torch threads while timing."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document (schema_version 1)."),
) -> None:
    """Time float vs int8 latency (median, p90, speed-up) in one interleaved run."""
    import torch

    import qplug_core as qp

    from qplug_core.commands._measure import interleaved_latency, latency_document
    from qplug_core.errors import InputMismatchError

    shape = parse_shape(example_shape)
    example = (example_tensor(shape, torch.Generator().manual_seed(0)),)
    with stdout_to_stderr():  # stdout is for the result: what the user's factory prints goes to stderr
        baseline, qmodel, baseline_kind = _models(target, example, backend)
    with progress() as bar:
        task = bar.add_task(f"timing ({runs} interleaved runs)", total=runs)
        try:
            latency = interleaved_latency(baseline, qmodel, example, runs, threads=threads,
                                          advance=lambda: bar.advance(task))
        except RuntimeError as exc:  # a saved model given the wrong --example-shape
            raise InputMismatchError(f"the model cannot run on an input of shape {shape}: "
                                     f"{' '.join(str(exc).split())[:300]}") from exc
    document = {"model": target, "baseline": baseline_kind,
                "backend": qp.quantization_report(qmodel).backend,
                "latency": latency_document(*latency, runs=runs, batch=shape[0], threads=threads)}
    if as_json:
        emit_json(document)
        return
    from rich.table import Table

    lat = document["latency"]
    table = Table(title=f"qplug bench — {target} on {document['backend']} (batch {shape[0]}, "
                        f"{runs} runs, {threads} thread(s))", title_justify="left")
    for column in ("", "median ms", "p90 ms"):
        table.add_column(column, justify="right" if column else "left")
    table.add_row(f"baseline: {baseline_kind}", f"{lat['float']['median_ms']:.3f}",
                  f"{lat['float']['p90_ms']:.3f}")
    table.add_row("int8", f"{lat['int8']['median_ms']:.3f}", f"{lat['int8']['p90_ms']:.3f}")
    show(table, f"speed-up: {lat['speedup']}x")


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)
