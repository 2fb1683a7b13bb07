"""``qplug demo``: quantize a small model end to end and show what int8 changed.

The point is a first run that proves the install works and shows the trade-off in numbers:
accuracy (or output SQNR for random-weight models), latency, size and the layers int8 hurt most.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import typer

from qplug_core.cli._accuracy import WORST_LAYERS, worst_layers_table
from qplug_core.cli._common import emit_json, number, progress
from qplug_core.cli._table import new_table, show

#: output SQNR the random-weight demo models reach on fbgemm (measured with ``qplug demo --model``)
RANDOM_WEIGHT_SQNR_DB = {"resnet18": 39, "mobilenet_v2": 12}


class DemoModel(str, Enum):
    digits = "digits"
    resnet18 = "resnet18"
    mobilenet_v2 = "mobilenet_v2"


@dataclass
class _Workload:
    """A float model with the data each measurement needs."""

    model: Any
    example: tuple
    calibration: list
    evaluation: tuple  # one batch for compare()
    timing: tuple  # inputs of one timed call
    float_accuracy: float | None = None
    test_set: tuple | None = None  # (x, y) for top-1 accuracy


def _digits_workload() -> _Workload:
    from qplug_core.zoo.digits import load_digits_tensors, train_digits_cnn

    model, float_accuracy = train_digits_cnn()
    x_train, _, x_test, y_test = load_digits_tensors()
    return _Workload(model, (x_train[:1],), [x_train[i:i + 64] for i in range(0, 512, 64)],
                     (x_test,), (x_test[:16],), float_accuracy, (x_test, y_test))


def _zoo_workload(name: str) -> _Workload:
    from qplug_core.zoo import calibrate_batchnorm, example_inputs, get_model

    model = get_model(name, seed=0)
    if name == DemoModel.mobilenet_v2.value:  # random BN statistics saturate int8 ranges
        calibrate_batchnorm(model, [example_inputs(name, batch=8, seed=s) for s in range(2)])
    return _Workload(model, example_inputs(name), [example_inputs(name, batch=4, seed=10 + s)
                                                   for s in range(4)],
                     example_inputs(name, batch=4, seed=99), example_inputs(name))


def run_demo(backend: str | None, model: DemoModel, runs: int) -> tuple[dict[str, Any], Any]:
    """Everything the demo shows as one JSON-safe document, and the QuantizationReport."""
    import qplug_core as qp
    from qplug_core.cli._measure import interleaved_latency, latency_document, model_sizes
    from qplug_core.flows.steps import resolve_backend
    from qplug_core.zoo.digits import accuracy

    chosen = resolve_backend(backend).require_available()
    with progress() as bar:
        task = bar.add_task("training the digits CNN" if model is DemoModel.digits
                            else f"building {model.value}", total=None)
        work = _digits_workload() if model is DemoModel.digits else _zoo_workload(model.value)
        bar.update(task, description=f"quantizing for {chosen.name}")
        qmodel = qp.quantize(work.model, work.example, work.calibration, backend=chosen,
                             progress=False)
        bar.update(task, description="comparing layers (SQNR)")
        fused = qp.fuse_fx(work.model, work.example, backend=chosen)
        comparison = qp.compare(fused, qmodel, [work.evaluation])
        bar.update(task, description=f"timing float vs int8 ({runs} interleaved runs)", total=runs)
        latency = interleaved_latency(work.model, qmodel, work.timing, runs,
                                      advance=lambda: bar.advance(task))
        sizes = model_sizes(work.model, qmodel)
    report = qp.quantization_report(qmodel)
    document: dict[str, Any] = {
        "model": model.value, "backend": chosen.name, "quantization": report.to_dict(),
        "latency": latency_document(*latency, runs=runs, batch=work.timing[0].shape[0],
                                    threads=1),
        "size": sizes.to_dict(),
        "sqnr": {"output_db": number(comparison.output_sqnr_db, 2),
                 "compared_against": "fused float model (qp.fuse_fx)",
                 "worst_layers": [layer.to_dict() for layer in comparison.worst(WORST_LAYERS)]},
    }
    if model is not DemoModel.digits:
        document["note"] = random_weights_note(model.value)
    if work.test_set is not None:
        document["accuracy"] = {"float": number(work.float_accuracy),
                                "int8": number(accuracy(qmodel, *work.test_set)),
                                "test_images": len(work.test_set[1])}
    return document, report


def random_weights_note(model: str) -> str:
    """What to expect from a model whose weights are random (nothing is downloaded)."""
    return (f"{model} has random weights (built from code, nothing downloaded), so there is no "
            f"accuracy to report, only output SQNR: expect about {RANDOM_WEIGHT_SQNR_DB[model]} dB. "
            "Random weights have no structure for int8 to exploit and the error compounds with "
            "depth; trained weights usually quantize better.")


def _summary_table(doc: dict[str, Any]) -> Any:
    table = new_table("", "float", "int8", "change", right=("float", "int8", "change"),
                      title=f"qplug demo — {doc['model']} on backend {doc['backend']}")
    if "accuracy" in doc:
        acc = doc["accuracy"]
        table.add_row(f"top-1 accuracy ({acc['test_images']} held-out images)",
                      f"{acc['float']:.2%}", f"{acc['int8']:.2%}",
                      f"{(acc['int8'] - acc['float']) * 100:+.2f} pt")
    table.add_row("output SQNR vs float", "", f"{doc['sqnr']['output_db']} dB", "")
    lat = doc["latency"]
    table.add_row(f"median latency (batch {lat['batch']}, {lat['runs']} runs, "
                  f"{lat['threads']} thread(s))",
                  f"{lat['float']['median_ms']:.3f} ms", f"{lat['int8']['median_ms']:.3f} ms",
                  f"{lat['speedup']}x faster")
    table.add_row("p90 latency", f"{lat['float']['p90_ms']:.3f} ms", f"{lat['int8']['p90_ms']:.3f} ms",
                  "")
    size = doc["size"]
    table.add_row("weights", f"{size['float_bytes'] / 1e3:,.1f} kB", f"{size['int8_bytes'] / 1e3:,.1f} kB",
                  f"{size['ratio']}x smaller")
    if size.get("file_bytes"):
        table.add_row("saved file (weights + graph)", "", f"{size['file_bytes'] / 1e3:,.1f} kB", "")
    return table


def demo(
    backend: str = typer.Option(None, "--backend", help="Backend to use (default: the best one here)."),
    model: DemoModel = typer.Option(DemoModel.digits, "--model",
                                    help="digits trains a small CNN in seconds; the others use "
                                         "random weights and report output SQNR."),
    runs: int = typer.Option(30, "--runs", min=3, help="Timed runs per model (interleaved)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document (schema_version 1)."),
) -> None:
    """Quantize a small model and show accuracy, latency, size and per-layer error, float vs int8."""
    document, report = run_demo(backend, model, runs)
    if as_json:
        emit_json(document)
        return
    show(*([document["note"]] if "note" in document else []),
         _summary_table(document), report, worst_layers_table(document["sqnr"]),
         f"size measured as: {document['size']['method']}")


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)
