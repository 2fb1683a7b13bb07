"""One-call static quantization of ResNet-18, qplug vs torch.ao (issue 7).

Run: ``python bench/bench_quantize.py [--reps 3] [--batches 32] [--observers] [--profile]``

Model: the zoo's ResNet-18 (seed 0) with BatchNorm statistics re-estimated on 4 batches
(``calibrate_batchnorm``) so activations have trained-like ranges; 32 calibration batches of
1x3x224x224 (seeded randn) and 8 held-out inputs (other seeds) for the output SQNR.

* qplug: ``qp.quantize(model, (x,), batches, backend="fbgemm")`` timed as one call, and the same
  job in stages (``prepare_fx`` / ``calibrate`` / ``convert_fx``) for the breakdown;
* torch.ao: ``prepare_fx`` with ``get_default_qconfig_mapping("fbgemm")`` (engine fbgemm) +
  calibration loop + ``convert_fx``, staged.

Variants are interleaved (rotating order per repetition); medians are shown, plus the best
(minimum) total, which is the least disturbed figure on a loaded shared machine. ``--observers`` adds
the activation-observer table (calibration time, convert time and SQNR with each candidate as the
global activation observer of qplug's default fbgemm mapping, everything else unchanged).
``--profile`` prints a cProfile of qplug's calibration.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
from _harness import machine_line, median, quiet, table, torch_ao

import qplug_core as qp
from qplug_core.analysis.layers import sqnr
from qplug_core.config import QConfig
from qplug_core.observers import (
    HistogramObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MSEObserver,
    PercentileObserver,
)
from qplug_core.zoo import calibrate_batchnorm, example_inputs, get_model


def make_model() -> torch.nn.Module:
    model = get_model("resnet18", seed=0)
    calibrate_batchnorm(model, [example_inputs("resnet18", batch=8, seed=1000 + s) for s in range(4)])
    return model.eval()


def data(batches: int, held_out: int) -> tuple[list[tuple[torch.Tensor]], list[tuple[torch.Tensor]]]:
    calib = [example_inputs("resnet18", batch=1, seed=s) for s in range(batches)]
    test = [example_inputs("resnet18", batch=1, seed=10_000 + s) for s in range(held_out)]
    return calib, test


@torch.no_grad()
def output_sqnr(model: torch.nn.Module, qmodel: torch.nn.Module, test: list[tuple[torch.Tensor]]) -> float:
    ref = torch.cat([model(*x) for x in test])
    out = torch.cat([qmodel(*x) for x in test])
    return sqnr(ref, out)


def count_observers(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes
               if n.op == "call_module" and "activation_post_process" in str(n.target))


# -- the jobs ----------------------------------------------------------------------------------------

def qplug_one_call(model, calib) -> dict:
    with quiet():
        start = time.perf_counter()
        qmodel = qp.quantize(model, calib[0], calib, backend="fbgemm", progress=False)
        total = time.perf_counter() - start
    return {"total": total, "model": qmodel}


def qplug_staged(model, calib, mapping=None) -> dict:
    with quiet():
        t0 = time.perf_counter()
        observed = qp.prepare_fx(model, mapping, calib[0], backend="fbgemm")
        t1 = time.perf_counter()
        qp.calibrate(observed, calib, progress=False)
        t2 = time.perf_counter()
        observers = count_observers(observed)
        qmodel = qp.convert_fx(observed, backend="fbgemm", inplace=True)
        t3 = time.perf_counter()
    return {"prepare": t1 - t0, "calibrate": t2 - t1, "convert": t3 - t2, "total": t3 - t0,
            "model": qmodel, "observers": observers}


def ao_staged(tq, model, calib) -> dict:
    with quiet():
        torch.backends.quantized.engine = "fbgemm"
        t0 = time.perf_counter()
        mapping = tq.get_default_qconfig_mapping("fbgemm")
        observed = tq.quantize_fx.prepare_fx(model, mapping, calib[0])
        t1 = time.perf_counter()
        with torch.no_grad():
            for x in calib:
                observed(*x)
        t2 = time.perf_counter()
        observers = count_observers(observed)
        qmodel = tq.quantize_fx.convert_fx(observed)
        t3 = time.perf_counter()
    return {"prepare": t1 - t0, "calibrate": t2 - t1, "convert": t3 - t2, "total": t3 - t0,
            "model": qmodel, "observers": observers}


@torch.no_grad()
def float_forwards(model, calib) -> dict:
    start = time.perf_counter()
    for x in calib:
        model(*x)
    return {"total": time.perf_counter() - start}


# -- observer candidates -----------------------------------------------------------------------------

CANDIDATES = [
    ("HistogramObserver (default)", HistogramObserver, {}),
    ("MinMaxObserver", MinMaxObserver, {}),
    ("MovingAverageMinMaxObserver", MovingAverageMinMaxObserver, {}),
    ("PercentileObserver(99.99)", PercentileObserver, {"percentile": 99.99}),
    ("PercentileObserver(99.9)", PercentileObserver, {"percentile": 99.9}),
    ("MSEObserver", MSEObserver, {}),
]


def mapping_with_activation(cls, extra: dict):
    """qplug's default fbgemm static mapping with the global activation observer replaced."""
    mapping = qp.get_default_qconfig_mapping("fbgemm")
    default = mapping.global_qconfig
    act = default.activation()
    kwargs = dict(dtype=act.dtype, quant_min=act.quant_min, quant_max=act.quant_max,
                  eps=float(act.eps))
    mapping.set_global(QConfig(activation=cls.with_args(**kwargs, **extra), weight=default.weight))
    return mapping


def observer_table(model, calib, test, reps: int) -> str:
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in CANDIDATES}
    mappings = {name: mapping_with_activation(cls, extra) for name, cls, extra in CANDIDATES}
    for rep in range(reps):
        names = list(mappings)
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            runs[name].append(qplug_staged(model, calib, mappings[name]))
    rows = []
    base = median([r["calibrate"] for r in runs[CANDIDATES[0][0]]])
    for name in runs:
        cal = median([r["calibrate"] for r in runs[name]])
        conv = median([r["convert"] for r in runs[name]])
        tot = median([r["total"] for r in runs[name]])
        rows.append([name, f"{cal:.2f}", f"{cal / len(calib) * 1e3:.0f}", f"{conv:.2f}",
                     f"{tot:.2f}", f"{cal / base:.2f}",
                     f"{output_sqnr(model, runs[name][-1]['model'], test):.2f}"])
    return table(["activation observer", "calib s", "ms/batch", "convert s", "total s",
                  "calib vs default", "SQNR dB"], rows)


def profile_calibration(model, calib, top: int) -> str:
    with quiet():
        observed = qp.prepare_fx(model, None, calib[0], backend="fbgemm")
        profiler = cProfile.Profile()
        profiler.enable()
        qp.calibrate(observed, calib, progress=False)
        profiler.disable()
        start = time.perf_counter()
        qp.convert_fx(observed, backend="fbgemm", inplace=True)
        convert_s = time.perf_counter() - start
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue() + f"\n(convert_fx after this calibration: {convert_s:.2f} s)\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batches", type=int, default=32)
    parser.add_argument("--held-out", type=int, default=8)
    parser.add_argument("--observers", action="store_true", help="activation-observer candidates")
    parser.add_argument("--observer-reps", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="cProfile qplug's calibration")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    tq = torch_ao()
    model = make_model()
    calib, test = data(args.batches, args.held_out)
    print(machine_line())
    print(f"ResNet-18 static PTQ (fbgemm), {args.batches} calibration batches of 1x3x224x224, "
          f"SQNR vs float on {args.held_out} held-out inputs, median of {args.reps} interleaved reps")

    variants = {"float forward x N (floor)": lambda: float_forwards(model, calib),
                "qplug qp.quantize (one call)": lambda: qplug_one_call(model, calib),
                "qplug staged": lambda: qplug_staged(model, calib)}
    if tq is not None:
        variants["torch.ao prepare/calib/convert"] = lambda: ao_staged(tq, model, calib)
    qplug_staged(model, calib[:2])  # warm-up: plugin loading, kernel self-tests
    if tq is not None:
        ao_staged(tq, model, calib[:2])
    runs: dict[str, list[dict]] = {k: [] for k in variants}
    names = list(variants)
    for rep in range(args.reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            runs[name].append(variants[name]())
            r = runs[name][-1]
            print(f"  rep {rep + 1}: {name}: " + ", ".join(
                f"{k} {v:.2f}s" for k, v in r.items() if isinstance(v, float)), flush=True)

    ao_total = median([r["total"] for r in runs[names[-1]]]) if tq is not None else float("nan")
    rows = []
    for name in names:
        rs = runs[name]
        tot = median([r["total"] for r in rs])
        cell = lambda key: f"{median([r[key] for r in rs]):.2f}" if key in rs[0] else "-"  # noqa: E731
        share = (f"{median([r['calibrate'] / r['total'] for r in rs]) * 100:.0f}%"
                 if "calibrate" in rs[0] else "-")
        q = rs[-1].get("model")
        best = min(r["total"] for r in rs)
        rows.append([name, f"{tot:.2f}", f"{best:.2f}", cell("prepare"), cell("calibrate"), cell("convert"), share,
                     str(rs[-1].get("observers", "-")),
                     f"{tot / ao_total:.2f}x" if tq is not None else "-",
                     f"{output_sqnr(model, q, test):.2f}" if q is not None else "-"])
    print()
    print(table(["variant", "total s", "best s", "prepare s", "calib s", "convert s", "calib share",
                 "observers", "vs torch.ao", "SQNR dB"], rows))
    if args.observers:
        print("\nActivation observer candidates (qplug, fbgemm default mapping with the global "
              f"activation observer replaced; median of {args.observer_reps} reps)")
        print(observer_table(model, calib, test, args.observer_reps))
    if args.profile:
        print("\ncProfile of qplug calibrate (default mapping), by own time")
        print(profile_calibration(model, calib, args.top))


if __name__ == "__main__":
    main()
