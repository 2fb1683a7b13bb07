"""``qplug bench``: float vs int8 latency of one model, timed in one interleaved run.

A speed-up is only ever quoted against the float model: for a saved file (which holds no float
original) give ``--float MODULE:FACTORY``, otherwise only the int8 latency is shown. The reference
form of a saved model (int8 simulated with float ops) is slower than float, so a ratio against it
would flatter int8.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from qplug_core.cli._common import emit_json, progress, warn
from qplug_core.cli._table import new_table, show
from qplug_core.cli.quantize import EXAMPLE_DTYPES, EXAMPLE_SHAPES
from qplug_core.registry.isolation import stdout_to_stderr

#: relative run-to-run spread ((p90 - p10) / median) above which the figures are flagged
NOISY_SPREAD = 0.25


def _models(target: str, float_spec: str | None, example: tuple, backend: str | None
            ) -> tuple[Any, Any]:
    """``(float model or None, int8 model)`` for a saved file or a MODULE:FACTORY."""
    import qplug_core as qp
    from qplug_core.cli._inputs import load_factory_model
    from qplug_core.cli._saved import load_saved
    from qplug_core.flows.steps import resolve_backend

    if Path(target).is_file():
        return (load_factory_model(float_spec) if float_spec else None,
                load_saved(Path(target), float_spec, backend=backend, command="bench"))
    model = load_factory_model(target)
    warn("calibrating on the example input: fine for timing, not for accuracy")
    qmodel = qp.quantize(model, example, [example], backend=resolve_backend(backend),
                         progress=False)
    return model, qmodel


def bench(
    target: str = typer.Argument(..., metavar="MODULE:FACTORY|PATH",
                                 help="A model factory, or a model saved by qp.save."),
    example_shapes: list[str] = EXAMPLE_SHAPES,
    example_dtypes: list[str] = EXAMPLE_DTYPES,
    float_spec: str = typer.Option(None, "--float", metavar="MODULE:FACTORY",
                                   help="For a saved model: its float original, to time against."),
    backend: str = typer.Option(None, "--backend", help="Backend (default: the best one here, or "
                                                        "the one a saved model was made for)."),
    runs: int = typer.Option(50, "--runs", min=3, help="Timed runs per model (interleaved)."),
    threads: int = typer.Option(1, "--threads", min=1, help="torch threads while timing."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document (schema_version 1)."),
) -> None:
    """Time int8 latency, and float vs int8 (speed-up) in one interleaved run when the float model
    is known."""
    from qplug_core.cli._inputs import input_specs
    from qplug_core.cli._measure import interleaved_latency, latency_document
    from qplug_core.cli._saved import backend_of
    from qplug_core.errors import InputMismatchError

    specs = input_specs(example_shapes, example_dtypes)
    example = tuple(spec.example() for spec in specs)
    with stdout_to_stderr():  # stdout is for the result: what the user's factory prints goes to stderr
        float_model, qmodel = _models(target, float_spec, example, backend)
    with progress() as bar:
        task = bar.add_task(f"timing ({runs} interleaved runs)", total=runs)
        try:
            latency = interleaved_latency(float_model, qmodel, example, runs, threads=threads,
                                          advance=lambda: bar.advance(task))
        except RuntimeError as exc:  # a saved model given the wrong --example-shape
            raise InputMismatchError(f"the model cannot run on the --example-shape inputs: "
                                     f"{' '.join(str(exc).split())[:300]}") from exc
    document = {"model": target, "float_model": float_spec or (None if float_model is None
                                                                else target),
                "backend": backend_of(qmodel),
                "latency": latency_document(*latency, runs=runs, batch=specs[0].shape[0],
                                            threads=threads)}
    noisy = [name for name in ("float", "int8") if (document["latency"].get(name) or {})
             .get("spread", 0) > NOISY_SPREAD]
    if noisy:
        warn(f"run-to-run spread above {NOISY_SPREAD:.0%} for {' and '.join(noisy)}: the machine "
             "is busy; close other work or raise --runs before quoting these figures")
    if as_json:
        emit_json(document)
        return
    lat = document["latency"]
    table = new_table("", "median ms", "p90 ms", "spread", right=("median ms", "p90 ms", "spread"),
                      title=f"qplug bench — {target} on {document['backend']} (batch "
                            f"{lat['batch']}, {runs} runs, {threads} thread(s))")
    for name in ("float", "int8"):
        if lat.get(name):
            table.add_row(name, f"{lat[name]['median_ms']:.3f}", f"{lat[name]['p90_ms']:.3f}",
                          f"{lat[name]['spread']:.0%}")
    show(table, f"speed-up of int8 over float: {lat['speedup']}x" if lat.get("speedup") else
         "no float model to compare with: pass --float MODULE:FACTORY for a speed-up")


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)
