"""qp.export_program of an fbgemm model, compiled by Inductor (x86 int8 lowering) and AOTInductor,
against the fbgemm model itself.

Run: ``python bench/bench_export_program.py [--model resnet18] [--rounds 20] [--threads 1] [--aoti]``

The zoo model (seed 0, BatchNorm statistics re-estimated), batch 1, is quantized for fbgemm; its
``qp.export_program`` (quantized_decomposed ops) runs eagerly, under ``torch.compile`` with
``torch._inductor.config.freezing = True`` (what Inductor's int8 lowering needs) and, with
``--aoti``, as an ``aoti_compile_and_package`` package. Latencies are measured round-robin in one
run (median ms, ratio to fbgemm); max |difference| to the reference form on a held-out input; the
Inductor counters say whether its int8 conv/linear patterns matched.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  (the namespace the program uses; bench only)
from _harness import interleaved, machine_line, median, quiet, table

import qplug_core as qp
from qplug_core.onnx_export import reference_form
from qplug_core.zoo import calibrate_batchnorm, example_inputs, get_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--aoti", action="store_true", help="also AOTInductor (minutes of C++ compilation)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_line())
    model = get_model(args.model, seed=0)
    calibrate_batchnorm(model, [example_inputs(args.model, batch=8, seed=1000 + s) for s in range(4)])
    calibration = [example_inputs(args.model, batch=1, seed=s) for s in range(8)]
    x = example_inputs(args.model, batch=1, seed=100)
    with quiet():
        fbgemm = qp.quantize(model.eval(), calibration[0], calibration, backend="fbgemm")
    start = time.perf_counter()
    program = qp.export_program(fbgemm, calibration[0])
    print(f"qp.export_program: {time.perf_counter() - start:.1f} s")
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config

    inductor_config.freezing = True
    variants = {"fbgemm": fbgemm, "program (eager)": program.module()}
    compiled = torch.compile(program.module())
    with torch.no_grad():
        start = time.perf_counter()
        compiled(*x)
        print(f"torch.compile (freezing) first call: {time.perf_counter() - start:.1f} s; int8 matches: "
              + str({k: v for k, v in counters["inductor"].items() if k.startswith("q")}))
    variants["torch.compile"] = compiled
    if args.aoti:
        counters.clear()
        start = time.perf_counter()
        path = torch._inductor.aoti_compile_and_package(
            program, package_path=str(Path(tempfile.mkdtemp()) / "model.pt2"),
            inductor_configs={"freezing": True})
        variants["AOTInductor"] = torch._inductor.aoti_load_package(path)
        print(f"aoti_compile_and_package: {time.perf_counter() - start:.1f} s; int8 matches: "
              + str({k: v for k, v in counters["inductor"].items() if k.startswith("q")}))
    with torch.no_grad():
        reference = reference_form(fbgemm)(*x)
        diffs = {name: float((fn(*x) - reference).abs().max()) for name, fn in variants.items()}
        samples = interleaved({name: (lambda fn=fn: fn(*x)) for name, fn in variants.items()},
                              args.rounds, warmup=3)
    base = median(samples["fbgemm"])
    print(table(["variant", "median ms", "ratio to fbgemm", "max |diff| to reference form"],
                [[name, f"{median(s) * 1e3:.2f}", f"{median(s) / base:.3f}", f"{diffs[name]:.3g}"]
                 for name, s in samples.items()]))


if __name__ == "__main__":
    main()
