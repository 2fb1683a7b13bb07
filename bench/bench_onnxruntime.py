"""Issue 14: qplug's onnxruntime backend against ONNX Runtime's own static quantizer, side by side.

For each model (batch 1, 3x224x224; random init with BatchNorm re-estimated, as in the zoo), the
same calibration images go to qplug (``backend="onnxruntime"``, default qconfig) and to
``onnxruntime.quantization.quantize_static`` (QDQ, defaults: MinMax, per-tensor weights) with U8S8
and S8S8; SQNR is against the float model on held-out images; latency is the median (and the
minimum, steadier on a loaded machine) of interleaved rounds, each session built with the same
thread count.

    python bench/bench_onnxruntime.py [--models resnet18 mobilenet_v2] [--threads 1 2] [--rounds 40]
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

import qplug_core as qp
from qplug_core.zoo import calibrate_batchnorm, get_model

logging.getLogger("torch.onnx").setLevel(logging.ERROR)


def images(seed: int, n: int) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, 3, 224, 224, generator=g),) for _ in range(n)]


def ort_quantized(model, calibration, workdir: Path, activation: str):
    """ORT's own QDQ model of ``model`` (exported float, pre-processed, quantize_static)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    float_path, pre_path = workdir / "float.onnx", workdir / "float_pre.onnx"
    if not float_path.exists():
        with quiet():
            torch.onnx.export(model, calibration[0], str(float_path), dynamo=True, input_names=["x"],
                              external_data=False)
        quant_pre_process(str(float_path), str(pre_path))

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.items = iter([{"x": b[0].numpy()} for b in calibration])

        def get_next(self):
            return next(self.items, None)

    out = workdir / f"ort_{activation}.onnx"
    act = QuantType.QUInt8 if activation == "u8s8" else QuantType.QInt8
    with quiet():
        quantize_static(str(pre_path), str(out), Reader(), quant_format=QuantFormat.QDQ,
                        activation_type=act, weight_type=QuantType.QInt8)
    return out


def session(path: Path, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def main() -> None:
    import qplug_onnxruntime

    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v2"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--calib", type=int, default=8)
    args = parser.parse_args()
    rows = []
    for name in args.models:
        torch.manual_seed(0)
        model = calibrate_batchnorm(get_model(name, seed=0), images(7, 4)).eval()
        calibration, held_out = images(1, args.calib), images(2, 4)
        with torch.no_grad():
            expected = torch.cat([model(*b) for b in held_out])
        with quiet():
            observed = qp.prepare_fx(model, None, calibration[0], backend="onnxruntime")
            qp.calibrate(observed, calibration)
        with tempfile.TemporaryDirectory() as tmp:
            ort_paths = {a: ort_quantized(model, calibration, Path(tmp), a) for a in ("u8s8", "s8s8")}
            for threads in args.threads:
                torch.set_num_threads(threads)
                qplug_onnxruntime.configure(num_threads=threads)
                with quiet():
                    qmodel = qp.convert_fx(observed)
                sessions = {a: session(p, threads) for a, p in ort_paths.items()}
                x = held_out[0][0]
                feeds = {"x": x.numpy()}
                variants = {"qplug onnxruntime": lambda: qmodel(x)}
                variants.update({f"ORT {a}": (lambda s=s: s.run(None, feeds)) for a, s in sessions.items()})
                with torch.no_grad():
                    samples = interleaved(variants, args.rounds, warmup=3)
                    sqnr = {"qplug onnxruntime": qp.sqnr(expected, torch.cat([qmodel(*b) for b in held_out]))}
                for a, s in sessions.items():
                    got = np.concatenate([s.run(None, {"x": b[0].numpy()})[0] for b in held_out])
                    sqnr[f"ORT {a}"] = qp.sqnr(expected, torch.from_numpy(got))
                best_ort = min(median(samples["ORT u8s8"]), median(samples["ORT s8s8"]))
                best_ort_min = min(min(samples["ORT u8s8"]), min(samples["ORT s8s8"]))
                for variant, times in samples.items():
                    rows.append([name, str(threads), variant, f"{min(times) * 1e3:.2f}",
                                 f"{median(times) * 1e3:.2f}", f"{p90(times) * 1e3:.2f}",
                                 f"{median(times) / median(samples['ORT u8s8']):.2f}",
                                 f"{median(times) / best_ort:.2f}", f"{min(times) / best_ort_min:.2f}",
                                 f"{sqnr[variant]:.2f}"])
    print(machine_line())
    print(table(["model", "threads", "variant", "min ms", "median ms", "p90 ms", "x ORT u8s8",
                 "x best ORT", "x best ORT (min)", "SQNR dB"], rows))


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    main()
