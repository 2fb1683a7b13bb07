"""Issue 24: which operand to make 7-bit on CPUs without VNNI, measured on the reference form.

Without VNNI, x86 int8 kernels sum pairs of u8 x s8 products in int16 with saturation, so either
the activations or the weights must be 7-bit (``qplug_core/kernels/arithmetic.py``). The reference
form is the arithmetic every backend must reproduce, and it is the same on every CPU, so this
compares the three choices on it (SQNR against float on held-out inputs): full 8-bit (what a VNNI
CPU runs), 7-bit activations (torch.ao's ``reduce_range``) and 7-bit weights (ORT's, the rule).
``--backends`` adds the real kernels of this host under the qparams the core derives for the host
and for an AVX2 CPU without VNNI (``QPLUG_CPU_FLAGS``-style override): the rule alone (7-bit
weights in every layer: the default mapping passed explicitly, as before per-layer choice) and
the per-layer choice (``flows/weight_bits.py``: the default mapping left to the backend), and
the same through ``qp.quantize`` with an accuracy target (it resolves the defaults itself before
prepare, as for every transformer; a target every model meets, so the all-int8 model). Each
backend cell is ``SQNR dB`` plus ``/N ref`` when N int8 layers fell back to the reference form
(a kernel or partition that failed its check at convert). With ``FBGEMM_ENABLE_INSTRUCTIONS=AVX2``
fbgemm's kernels really run without VNNI (emulated AVX2 on a VNNI host); ONNX Runtime's MLAS
cannot be forced, so its figures are those of the host's kernels.

    python bench/cpu_without_vnni.py [--models digits resnet18 mobilenet_v2] [--backends fbgemm onnxruntime]
"""

from __future__ import annotations

import argparse
import warnings

import torch
from _harness import machine_line, table

import qplug_core as qp
from qplug_core.kernels.cpu import override_cpu_flags
from qplug_core.plugin_api import default_qconfig_mapping
from qplug_core.zoo import calibrate_batchnorm, example_inputs, get_model

AVX2 = "fpu sse sse2 avx avx2 fma"
#: a target every model meets: qp.quantize's algorithm path (defaults resolved before prepare)
ALL_INT8 = qp.Target(sqnr=-100.0)
CHOICES = {"8-bit (VNNI)": {}, "7-bit activations": {"reduce_range": True},
           "7-bit weights (rule)": {"weight_quant_min": -64, "weight_quant_max": 64}}


def model_and_data(name: str):
    if name == "digits":
        from qplug_core.zoo.digits import load_digits_tensors, train_digits_cnn

        model, _ = train_digits_cnn()
        _, _, x_test, _ = load_digits_tensors()
        return model, [(x_test[i:i + 32],) for i in range(0, 256, 32)], [(x_test[256:512],)]
    model = get_model(name, seed=0).eval()
    calibrate_batchnorm(model, [example_inputs(name, batch=8, seed=s) for s in range(2)])
    calib = [example_inputs(name, batch=4, seed=10 + s) for s in range(4)]
    return model, calib, [example_inputs(name, batch=4, seed=99)]


def sqnr(model, float_model, held_out) -> float:
    with torch.no_grad():
        return float(sum(qp.sqnr(float_model(*x), model(*x)) for x in held_out) / len(held_out))


def reference_sqnr(model, calib, held_out, options: dict) -> float:
    mapping = default_qconfig_mapping("static", per_channel=True, **options)
    observed = qp.calibrate(qp.prepare_fx(model, mapping, calib[0], backend="reference"), calib)
    return sqnr(qp.convert_to_reference_fx(observed), model, held_out)


def backend_sqnr(model, calib, held_out, backend: str, mapping=None, *, one_call: bool = False) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if one_call:  # qp.quantize with a target: it resolves the defaults before prepare
            converted = qp.quantize(model, calib[0], calib, backend=backend, target=ALL_INT8)
        else:
            observed = qp.calibrate(qp.prepare_fx(model, mapping, calib[0], backend=backend), calib)
            converted = qp.convert_fx(observed)
    fallback = len(qp.quantization_report(converted).reference)
    return f"{sqnr(converted, model, held_out):.1f}" + (f" /{fallback} ref" if fallback else "")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["digits", "resnet18", "mobilenet_v2"])
    parser.add_argument("--backends", nargs="*", default=[])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(machine_line())
    rows = []
    for name in args.models:
        model, calib, held_out = model_and_data(name)
        row = [name] + [f"{reference_sqnr(model, calib, held_out, o):.1f}" for o in CHOICES.values()]
        for backend in args.backends:
            row.append(backend_sqnr(model, calib, held_out, backend))
            with override_cpu_flags(AVX2):
                rule = qp.get_default_qconfig_mapping(backend)  # explicit: no per-layer choice
                row.append(backend_sqnr(model, calib, held_out, backend, rule))
                row.append(backend_sqnr(model, calib, held_out, backend))
                row.append(backend_sqnr(model, calib, held_out, backend, one_call=True))
        rows.append(row)
    header = ["model", *(f"reference {c}" for c in CHOICES)]
    for backend in args.backends:
        header += [f"{backend} (host qparams)", f"{backend} (AVX2: 7-bit rule)",
                   f"{backend} (AVX2: per layer)", f"{backend} (AVX2: qp.quantize target)"]
    print(table(header, rows))


if __name__ == "__main__":
    main()
