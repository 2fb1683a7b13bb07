"""Inference latency of int8 models, qplug vs torch.ao vs float (issue 7).

Run: ``python bench/bench_latency.py [--models resnet18 mobilenet_v2] [--rounds 60] [--calib 8]``

For each model (zoo, seed 0, BatchNorm statistics re-estimated with ``calibrate_batchnorm`` on 4
batches so that activations look trained) at 1x3x224x224 and ``torch.set_num_threads(2)``:

* ``float``            eager float model;
* ``qplug fbgemm``     ``qp.prepare_fx`` / ``qp.calibrate`` / ``qp.convert_fx`` with backend fbgemm;
* ``qplug qnnpack``    the same with backend qnnpack (slower than float on x86; shown anyway);
* ``torch.ao fbgemm``  torch.ao's own FX flow, ``prepare_fx(get_default_qconfig_mapping("fbgemm"))``
                       / same calibration batches / ``convert_fx`` (comparison only);
* MobileNetV2 also gets ``channels_last`` variants (input in channels_last; the float model too).

All variants of one model are timed round-robin in a rotating order (one call per variant per
round), so machine noise hits them alike; the table shows median and p90 latency in ms, the ratio
to float and to torch.ao (median), and the output SQNR vs float on held-out inputs. The global
quantized engine is set to each variant's engine before its call (un-packed ops such as quantized
add dispatch on it). ResNet-18's model size (float state_dict vs int8 packed weights, and the
serialized torch.save / qp.save sizes) is printed below its table.
"""

from __future__ import annotations

import argparse
import io
import os
import tempfile
from typing import Callable

import torch
from _harness import interleaved, machine_line, median, p90, quiet, table, torch_ao
from torch import nn

import qplug_core as qp
from qplug_core.analysis.layers import sqnr
from qplug_core.zoo import calibrate_batchnorm, example_inputs, get_model


def make_model(name: str) -> nn.Module:
    model = get_model(name, seed=0)
    calibrate_batchnorm(model, [example_inputs(name, batch=8, seed=1000 + s) for s in range(4)])
    return model.eval()


def qplug_int8(model: nn.Module, calib, backend: str) -> nn.Module:
    with quiet():
        observed = qp.prepare_fx(model, None, calib[0], backend=backend)
        qp.calibrate(observed, calib, progress=False)
        return qp.convert_fx(observed, backend=backend, inplace=True)


def ao_int8(tq, model: nn.Module, calib, engine: str = "fbgemm") -> nn.Module:
    with quiet():
        torch.backends.quantized.engine = engine
        observed = tq.quantize_fx.prepare_fx(model, tq.get_default_qconfig_mapping(engine), calib[0])
        with torch.no_grad():
            for x in calib:
                observed(*x)
        return tq.quantize_fx.convert_fx(observed)


def runner(model: nn.Module, x: torch.Tensor, engine: str | None) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        if engine is not None:
            torch.backends.quantized.engine = engine
        with torch.inference_mode():
            return model(x)
    return run


@torch.inference_mode()
def output_sqnr(ref_model: nn.Module, model: nn.Module, test, engine: str | None,
                channels_last: bool = False) -> float:
    if engine is not None:
        torch.backends.quantized.engine = engine
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    ref = torch.cat([ref_model(*x) for x in test])
    out = torch.cat([model(x[0].contiguous(memory_format=fmt)) for x in test])
    return sqnr(ref, out.float())


# -- sizes -----------------------------------------------------------------------------------------

def _qtensor_bytes(t: torch.Tensor) -> int:
    if not t.is_quantized:
        return t.numel() * t.element_size()
    size = t.numel() * t.element_size()
    if t.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric,
                       torch.per_channel_affine_float_qparams):
        size += t.q_per_channel_scales().numel() * 4 + t.q_per_channel_zero_points().numel() * 4
    else:
        size += 8
    return size


def _packed_objects(module: nn.Module) -> list:
    found = []
    for attr in ("_packed", "_packed_params"):
        obj = getattr(module, attr, None)
        if obj is None:
            continue
        inner = getattr(obj, "_packed_params", obj)  # torch.ao Linear wraps the packed object
        if hasattr(inner, "unpack"):
            found.append(inner)
    return found


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights a model holds: int8 packed weights (+ per-channel qparams, float
    bias) for kernel modules, float parameters/buffers elsewhere. Counted the same way for
    qplug and torch.ao, independent of either's serialization format."""
    total = 0
    with quiet():
        for module in model.modules():
            for packed in _packed_objects(module):
                weight, bias = packed.unpack()[:2]
                total += _qtensor_bytes(weight) + (_qtensor_bytes(bias) if bias is not None else 0)
            for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
                total += tensor.numel() * tensor.element_size()
    return total


def torch_save_bytes(model: nn.Module) -> int | None:
    buffer = io.BytesIO()
    try:
        with quiet():
            torch.save(model.state_dict(), buffer)
    except Exception:
        return None
    return buffer.tell()


def qp_save_bytes(model: nn.Module) -> int | str:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.safetensors")
        try:
            with quiet():
                qp.save(model, path)
        except Exception as error:  # qp.save is new; report why it did not work
            return f"n/a ({type(error).__name__})"
        return os.path.getsize(path)


def mb(n) -> str:
    if isinstance(n, int) and n < 4096:
        return f"empty ({n} B)"
    return f"{n / 2**20:.2f} MB" if isinstance(n, int) else str(n)


# -- main ------------------------------------------------------------------------------------------

def bench_model(name: str, args, tq) -> None:
    model = make_model(name)
    calib = [example_inputs(name, batch=1, seed=s) for s in range(args.calib)]
    test = [example_inputs(name, batch=1, seed=10_000 + s) for s in range(args.held_out)]
    x = example_inputs(name, batch=1, seed=20_000)[0]
    x_cl = x.contiguous(memory_format=torch.channels_last)
    models: dict[str, tuple[nn.Module, str | None]] = {"float": (model, None)}
    models["qplug fbgemm"] = (qplug_int8(model, calib, "fbgemm"), "fbgemm")
    if not args.no_qnnpack:
        models["qplug qnnpack"] = (qplug_int8(model, calib, "qnnpack"), "qnnpack")
    if tq is not None:
        models["torch.ao fbgemm"] = (ao_int8(tq, model, calib), "fbgemm")
    variants = {k: runner(m, x, e) for k, (m, e) in models.items()}
    channels_last = name in args.channels_last
    if channels_last:
        float_cl = make_model(name).to(memory_format=torch.channels_last)
        models["float channels_last"] = (float_cl, None)
        for key in list(models):
            if key.startswith("float"):
                continue
            models[f"{key} channels_last"] = models[key]
        for key, (m, e) in models.items():
            if key.endswith("channels_last"):
                variants[key] = runner(m, x_cl, e)
    samples = interleaved(variants, args.rounds, warmup=args.warmup)
    float_med = median(samples["float"])
    ao_med = {cl: median(samples[f"torch.ao fbgemm{cl}"]) for cl in ("", " channels_last")
              if f"torch.ao fbgemm{cl}" in samples}
    rows = []
    for key, times in samples.items():
        m, engine = models[key]
        cl = " channels_last" if key.endswith("channels_last") else ""
        med = median(times)
        ref_ao = ao_med.get(cl)
        sq = ("inf" if key == "float" else
              f"{output_sqnr(model, m, test, engine, channels_last=bool(cl)):.2f}")
        rows.append([key, f"{med * 1e3:.2f}", f"{p90(times) * 1e3:.2f}", f"{med / float_med:.2f}x",
                     f"{med / ref_ao:.2f}x" if ref_ao else "-", sq])
    print(f"\n{name} @ 1x3x224x224, {torch.get_num_threads()} threads, {args.rounds} interleaved "
          f"rounds, calibration {args.calib} batches, SQNR on {args.held_out} held-out inputs")
    print(table(["variant", "median ms", "p90 ms", "vs float", "vs torch.ao", "SQNR dB"], rows))
    if name == "resnet18":
        sizes = [["float", mb(weight_bytes(model)), mb(torch_save_bytes(model)), "-"]]
        for key in ("qplug fbgemm", "torch.ao fbgemm"):
            if key in models:
                m = models[key][0]
                sizes.append([key, mb(weight_bytes(m)), mb(torch_save_bytes(m)),
                              mb(qp_save_bytes(m)) if key.startswith("qplug") else "-"])
        base = weight_bytes(model)
        for row, key in zip(sizes[1:], [k for k in ("qplug fbgemm", "torch.ao fbgemm") if k in models]):
            row.append(f"{base / weight_bytes(models[key][0]):.2f}x smaller")
        sizes[0].append("-")
        print("\nResNet-18 model size (torch.save 'empty': the packed weights are not in the "
              "state_dict)")
        print(table(["model", "weight bytes", "torch.save(state_dict)", "qp.save", "float/int8"],
                    sizes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v2"])
    parser.add_argument("--channels-last", nargs="*", default=["mobilenet_v2"],
                        help="models that also get channels_last variants")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--calib", type=int, default=8, help="calibration batches (1x3x224x224)")
    parser.add_argument("--held-out", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-qnnpack", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tq = torch_ao()
    print(machine_line())
    for name in args.models:
        bench_model(name, args, tq)
    print(f"\nload avg at end: {machine_line().rpartition('load avg ')[2]}")


if __name__ == "__main__":
    main()
