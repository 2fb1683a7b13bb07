"""Issue 24: every zoo model on the int8 kernels of a CPU without VNNI, for real, on any x86 host.

Each model is quantized with ``qp.quantize`` defaults in a process on QEMU's emulated Haswell
(``tests/support/emulated.py``: AVX2, no AVX-512, VNNI or AMX; ``apt-get install qemu-user``),
where ONNX Runtime's MLAS, FBGEMM and oneDNN run their AVX2 kernels, whose u8 x s8 pair sums
saturate at int16. It prints, per model and backend, the SQNR against float of the compiled model
and of its reference form (what the kernels must reproduce), the share of output elements within
one step of the reference form, and the layers convert kept in the reference form; and the host's
reference form with 8-bit weights and activations (what a VNNI CPU's decisions give) beside them.
Emulated vector code runs ~3000x slower than the host's, so the 224x224 models run at 32x32 (the
kernels' arithmetic does not depend on the image size): ~30 min for the default set.

    python bench/emulated_cpu_without_vnni.py [--models digits_cnn resnet18 ...] [--backends onnxruntime fbgemm]
"""

from __future__ import annotations

import argparse
import tempfile
import warnings
from pathlib import Path

import torch
from _harness import machine_line, table

import qplug_core as qp
from qplug_core.kernels.cpu import override_cpu_flags
from qplug_core.zoo import calibrate_batchnorm, example_inputs, get_model
from tests.support.emulated import CPU_MODEL, quantize_emulated

#: the host decides as a VNNI CPU would (8-bit weights and activations everywhere)
VNNI = "fpu sse2 avx avx2 fma avx512f avx512bw avx512_vnni"
SIZE = 32


def model_and_data(name: str):
    """(model, calibration batches, held-out input) at a size the emulation runs in minutes."""
    if name == "digits_cnn":
        from qplug_core.zoo.digits import load_digits_tensors, train_digits_cnn

        model, _ = train_digits_cnn()
        _, _, x, _ = load_digits_tensors()
        return model, [(x[i:i + 32],) for i in range(0, 128, 32)], (x[128:384],)
    model = get_model(name, seed=0).eval()

    def shape(batch: int, seed: int) -> tuple:
        """The zoo's inputs, images at SIZE x SIZE."""
        return tuple(torch.nn.functional.interpolate(t, size=(SIZE, SIZE)) if t.dim() == 4 else t
                     for t in example_inputs(name, batch=batch, seed=seed))

    if any(t.dim() == 4 for t in example_inputs(name)):
        calibrate_batchnorm(model, [shape(4, s) for s in range(2)])
    return model, [shape(4, 10 + s) for s in range(4)], shape(8, 99)


def host_reference_sqnr(model, calibration, held_out) -> float:
    """The reference form's SQNR with a VNNI CPU's decisions (8-bit weights), on this host."""
    with warnings.catch_warnings(), override_cpu_flags(VNNI):
        warnings.simplefilter("ignore")
        qmodel = qp.quantize(model, calibration[0], calibration, backend="reference")
        with torch.no_grad():
            return float(qp.sqnr(model(*held_out), qmodel(*held_out)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["digits_cnn", "resnet18", "mobilenet_v2", "resnet50",
                                                        "bert_encoder"])
    parser.add_argument("--backends", nargs="+", default=["onnxruntime", "fbgemm"])
    args = parser.parse_args()
    print(machine_line(), f"| emulated CPU: qemu-x86_64 -cpu {CPU_MODEL}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            model, calibration, held_out = model_and_data(name)
            cases = {b: {"backend": b, "flags": None} for b in args.backends}
            result = quantize_emulated(Path(tmp) / f"{name}.pt", model, calibration, held_out, cases)
            vnni = host_reference_sqnr(model, calibration, held_out)
            for backend in args.backends:
                r = result[backend]
                rows.append([name, backend, f"{r['sqnr']:.2f}", f"{r['reference_sqnr']:.2f}",
                             f"{100 * r['within_one_step']:.2f}%", f"{vnni:.2f}",
                             ", ".join(r["reference_form"]) or "-"])
            print(f"{name} ({result['cpu']}; float output {result['float_error']:.1e} of its largest value "
                  f"from the host's): " + "; ".join(" | ".join(row[1:]) for row in rows[-len(args.backends):]),
                  flush=True)
    print(table(["model", "backend", "SQNR on AVX2 kernels", "its reference form", "within 1 step",
                 "reference form, VNNI decisions (host)", "kept in reference form"], rows))


if __name__ == "__main__":
    main()
