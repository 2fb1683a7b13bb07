"""Issue 29: every int8 runtime side by side, one interleaved run, 1 and 2 threads.

For each model (ResNet-18 and MobileNetV2 of the zoo at 1x3x224x224 with BatchNorm re-estimated,
the digits CNN at 1x1x28x28; batch 1) the same calibration inputs go to qplug (each backend's
default qconfig: ``fbgemm``, ``onnxruntime``, ``openvino``), to ONNX Runtime's own
``quantize_static`` (QDQ U8S8, its defaults; ``bench_onnxruntime.ort_quantized``) and to
OpenVINO + NNCF (``nncf.quantize`` of the float ONNX model, its defaults). Both OpenVINO variants
compile with the same properties (qplug-openvino's: latency, one stream, f32 between int8 ops).
Latency is the median (and p90) of interleaved rounds; "x best" is the ratio to the fastest
median of that model and thread count; SQNR is against the float model on held-out inputs.

    python bench/bench_runtimes.py [--models resnet18 mobilenet_v2 digits_cnn] [--threads 1 2] [--rounds 30]
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from _harness import interleaved, machine_line, median, p90, quiet, table
from bench_onnxruntime import images, ort_quantized, session

import qplug_core as qp
from qplug_core.zoo import calibrate_batchnorm, example_inputs, get_model

logging.getLogger("torch.onnx").setLevel(logging.ERROR)
QPLUG_BACKENDS = ("fbgemm", "onnxruntime", "openvino")


def model_and_data(name: str, calib: int):
    """(float model, calibration inputs, held-out inputs) of one bench model."""
    if name == "digits_cnn":
        def data(seed: int, n: int):
            return [example_inputs(name, batch=1, seed=seed * 1000 + i) for i in range(n)]
        return get_model(name, seed=0).eval(), data(1, calib), data(2, 4)
    torch.manual_seed(0)
    model = calibrate_batchnorm(get_model(name, seed=0), images(7, 4)).eval()
    return model, images(1, calib), images(2, 4)


def nncf_quantized(float_onnx: Path, calibration):
    """OpenVINO + NNCF's int8 model of the float ONNX model (``nncf.quantize`` defaults)."""
    import nncf
    import openvino

    dataset = nncf.Dataset(calibration, lambda batch: batch[0].numpy())
    with quiet():
        return nncf.quantize(openvino.Core().read_model(str(float_onnx)), dataset,
                             subset_size=len(calibration))


def main() -> None:
    import openvino

    import qplug_onnxruntime
    import qplug_openvino

    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v2", "digits_cnn"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calib", type=int, default=8)
    args = parser.parse_args()
    rows = []
    for name in args.models:
        model, calibration, held_out = model_and_data(name, args.calib)
        with torch.no_grad():
            expected = torch.cat([model(*b) for b in held_out])
        observed = {}
        for backend in QPLUG_BACKENDS:
            with quiet():
                observed[backend] = qp.prepare_fx(model, None, calibration[0], backend=backend)
                qp.calibrate(observed[backend], calibration)
        with tempfile.TemporaryDirectory() as tmp:
            ort_path = ort_quantized(model, calibration, Path(tmp), "u8s8")
            nncf_model = nncf_quantized(Path(tmp) / "float.onnx", calibration)
            for threads in args.threads:
                torch.set_num_threads(threads)
                qplug_onnxruntime.configure(num_threads=threads)
                qplug_openvino.configure(num_threads=threads)
                with quiet():
                    qmodels = {f"qplug {b}": qp.convert_fx(o) for b, o in observed.items()}
                ort = session(ort_path, threads)
                properties = qplug_openvino.CompileSettings(num_threads=threads).properties()
                nncf_request = openvino.Core().compile_model(nncf_model, "CPU", properties).create_infer_request()

                def run_ort(x: torch.Tensor) -> np.ndarray:
                    return ort.run(None, {"x": x.numpy()})[0]

                def run_nncf(x: torch.Tensor) -> np.ndarray:
                    return nncf_request.infer([x.numpy()], share_inputs=True, share_outputs=False)[0]

                x = held_out[0][0]
                variants = {"fp32 eager": lambda: model(x)}
                variants.update({v: (lambda m=m: m(x)) for v, m in qmodels.items()})
                variants.update({"ORT quantize_static u8s8": lambda: run_ort(x),
                                 "OpenVINO + NNCF": lambda: run_nncf(x)})
                with torch.no_grad():
                    samples = interleaved(variants, args.rounds, warmup=3)
                    outputs = {"fp32 eager": expected}
                    outputs.update({v: torch.cat([m(*b) for b in held_out]) for v, m in qmodels.items()})
                outputs["ORT quantize_static u8s8"] = torch.cat([torch.from_numpy(run_ort(b[0])) for b in held_out])
                outputs["OpenVINO + NNCF"] = torch.cat([torch.from_numpy(run_nncf(b[0])) for b in held_out])
                best = min(median(t) for t in samples.values())
                for variant, times in samples.items():
                    sqnr = "-" if variant == "fp32 eager" else f"{qp.sqnr(expected, outputs[variant]):.2f}"
                    rows.append([name, str(threads), variant, f"{median(times) * 1e3:.2f}",
                                 f"{p90(times) * 1e3:.2f}", f"{median(times) / best:.2f}", sqnr])
    print(machine_line())
    print(table(["model", "threads", "variant", "median ms", "p90 ms", "x best", "SQNR dB"], rows))


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    main()
