"""Symbolic tracing vs torch.export capture on the zoo CNNs: same int8 model, same speed (issue 13).

Run: ``python bench/bench_export_parity.py [--models resnet18 mobilenet_v2] [--rounds 40]``

For each model (zoo, seed 0, BatchNorm statistics re-estimated so activations look trained),
batch 1 at 224x224, ``torch.set_num_threads(2)``:

* SQNR of the fbgemm int8 model vs float on 4 held-out batches, for ``capture="symbolic"`` and
  ``capture="export"`` (and whether the two int8 models give bit-identical outputs);
* latency of both int8 models, measured round-robin in one run (median ms, ratio export/symbolic);
* ``prepare_fx`` time, median of 5 alternating runs: symbolic from the module, export from the module
  (torch.export included), and export from an ``ExportedProgram`` made beforehand (capture excluded).
"""

from __future__ import annotations

import argparse
import time

import torch
from _harness import interleaved, machine_line, median, quiet, table

import qplug_core as qp
from qplug_core.zoo import calibrate_batchnorm, example_inputs, get_model


def make_model(name: str) -> torch.nn.Module:
    model = get_model(name, seed=0)
    calibrate_batchnorm(model, [example_inputs(name, batch=8, seed=1000 + s) for s in range(4)])
    return model.eval()


def int8(model, calibration, capture: str):
    with quiet():
        observed = qp.prepare_fx(model, None, calibration[0], backend="fbgemm", capture=capture)
        qp.calibrate(observed, calibration, progress=False)
        return qp.convert_fx(observed, inplace=True)


def sqnr_db(model, quantized, batches) -> float:
    with torch.no_grad():
        ref = torch.cat([model(*x).flatten() for x in batches])
        out = torch.cat([quantized(*x).flatten() for x in batches])
    return qp.sqnr(ref, out)


def prepare_seconds(model, example, program, runs: int = 5) -> dict[str, float]:
    variants = {"symbolic": (model, "symbolic"), "export": (model, "export"),
                "exported program": (program, "auto")}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(runs):
        for key, (given, capture) in variants.items():
            with quiet():
                start = time.perf_counter()
                qp.prepare_fx(given, None, example, backend="fbgemm", capture=capture)
                times[key].append(time.perf_counter() - start)
    return {k: median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["resnet18", "mobilenet_v2"])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_line())
    rows, prep_rows = [], []
    for name in args.models:
        model = make_model(name)
        calibration = [example_inputs(name, batch=1, seed=s) for s in range(8)]
        held_out = [example_inputs(name, batch=1, seed=100 + s) for s in range(4)]
        symbolic, exported = int8(model, calibration, "symbolic"), int8(model, calibration, "export")
        x = held_out[0]
        with torch.no_grad():
            identical = all(torch.equal(symbolic(*b), exported(*b)) for b in held_out)
            samples = interleaved({"symbolic": lambda s=symbolic, b=x: s(*b),
                                   "export": lambda e=exported, b=x: e(*b)}, args.rounds, warmup=3)
        s_ms, e_ms = median(samples["symbolic"]) * 1e3, median(samples["export"]) * 1e3
        rows.append([name, f"{sqnr_db(model, symbolic, held_out):.2f}",
                     f"{sqnr_db(model, exported, held_out):.2f}", str(identical),
                     f"{s_ms:.2f}", f"{e_ms:.2f}", f"{e_ms / s_ms:.3f}"])
        program = torch.export.export(model, calibration[0], strict=False)
        prep = prepare_seconds(model, calibration[0], program)
        prep_rows.append([name, f"{prep['symbolic']:.3f}", f"{prep['export']:.3f}",
                          f"{prep['exported program']:.3f}",
                          f"{prep['export'] / prep['symbolic']:.2f}",
                          f"{prep['exported program'] / prep['symbolic']:.2f}"])
    print(table(["model", "SQNR symbolic dB", "SQNR export dB", "identical", "symbolic ms",
                 "export ms", "export/symbolic"], rows))
    print()
    print(table(["prepare_fx s", "symbolic", "export (incl. torch.export)", "from ExportedProgram",
                 "ratio incl.", "ratio excl."], prep_rows))


if __name__ == "__main__":
    main()
