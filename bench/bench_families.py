"""Per-family accuracy of static int8 with defaults on fbgemm (issue 30).

Run: ``python bench/bench_families.py [--families swinv2 albert ...] [--no-ao] [--threads 1]``

Each family of ``tests.support.hf_families`` (config-built, random weights, one or two small
stages or layers, batch 2) is quantized with ``qp.quantize(model, example, calibration,
backend="fbgemm")`` (8 calibration batches) and with ``recipe="none"`` (no SmoothQuant); the table
shows the output cosine vs float on 4 held-out batches. The oracle column is torch.ao's reference
form (``prepare_fx`` with ``get_default_qconfig_mapping("fbgemm")``, calibrate,
``convert_to_reference_fx``) on the same graph qplug quantizes: ``torch.export`` with static shapes
raised to module level (``qplug_core.flows.raise_aten``), comparison only. To see a change, run this
script in the old and the new tree (``PYTHONPATH=<tree>``) and compare the columns.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from _harness import machine_line, quiet, table, torch_ao

import qplug_core as qp
from qplug_core.flows.raise_aten import raise_aten_graph
from tests.support.hf_families import FAMILIES, build_family, family_inputs

CALIBRATION, HELD_OUT = range(1, 9), range(50, 54)


def _cosine(model, quantized, batches) -> float:
    with torch.no_grad():
        a = torch.cat([model(*x).flatten() for x in batches]).double()
        b = torch.cat([quantized(*x).flatten() for x in batches]).double()
    return float(F.cosine_similarity(a, b, dim=0))


def _oracle(tq, model, example, calibration) -> torch.nn.Module:
    gm = raise_aten_graph(torch.export.export(model, example, strict=False).module()).graph_module
    torch.backends.quantized.engine = "fbgemm"
    observed = tq.quantize_fx.prepare_fx(gm, tq.get_default_qconfig_mapping("fbgemm"), example)
    with torch.no_grad():
        for batch in calibration:
            observed(*batch)
    return tq.quantize_fx.convert_to_reference_fx(observed)


def run(name: str, tq) -> list[str]:
    model = build_family(name)
    example = family_inputs(name, seed=0)
    calibration = [family_inputs(name, seed=s) for s in CALIBRATION]
    held_out = [family_inputs(name, seed=s) for s in HELD_OUT]
    cells = [name]
    start = time.perf_counter()
    for recipe in ("auto", "none"):
        with quiet():
            quantized = qp.quantize(model, example, calibration, backend="fbgemm", recipe=recipe,
                                    progress=False)
        cells.append(f"{_cosine(model, quantized, held_out):.5f}")
    seconds = time.perf_counter() - start
    if tq is None:
        cells.append("-")
    else:
        try:
            with quiet():
                cells.append(f"{_cosine(model, _oracle(tq, model, example, calibration), held_out):.5f}")
        except Exception as error:  # the oracle is torch.ao's FX flow; some graphs it cannot take
            cells.append(f"fails ({type(error).__name__})")
    cells.append(f"{seconds:.1f}")
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--no-ao", action="store_true", help="skip torch.ao's reference form")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tq = None if args.no_ao else torch_ao()
    print(machine_line())
    rows = []
    for name in args.families:
        rows.append(run(name, tq))
        print("  " + " | ".join(rows[-1]), flush=True)
    print(table(["family", "cosine, defaults", "cosine, recipe='none'", "torch.ao reference (oracle)",
                 "qplug s (both)"], rows))


if __name__ == "__main__":
    main()
