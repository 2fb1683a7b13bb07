"""RAM a converted model holds, per backend: fbgemm (lowered kernels) against the delegates
(onnxruntime, openvino), on a 67M-parameter MLP and a config-built BERT (4 layers, hidden 512).

Each case runs in a fresh subprocess (the runtimes' allocators keep what they freed): the RSS the
float model added, the RSS the converted model added on top of it (with the float model still
alive, as after ``qp.quantize``), and what is left once both are deleted (a runtime's arenas);
then what the converted model holds, from Python: float and int8 tensor bytes reachable from it
(modules, attributes, meta: ``qplug_core/testing/held_tensors.py``), the ONNX bytes its compiled
partitions keep, and its sessions / compiled models. RSS is read after ``gc.collect()`` and
``malloc_trim(0)``.

``--latency`` also times the converted model of each case on its example (one thread, median
of ``--rounds``) in the same subprocess. ``--warm`` quantizes a two-layer MLP on the same backend
before the baseline is read, so that what a process pays once (the exporter's and the runtime's
modules, code pages, caches: ~145 MiB with openvino) is not counted as the model's.

    python bench/bench_delegate_memory.py [--models mlp bert] [--backends fbgemm onnxruntime openvino] [--warm]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
from _harness import machine_line, median, rss_bytes, table

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20


def build(name: str) -> tuple[torch.nn.Module, tuple, list[tuple]]:
    """The float model, its example inputs and calibration batches (fixed seeds)."""
    torch.manual_seed(0)
    if name == "mlp":  # 8 Linear 2048x4096 / 4096x2048: 67M parameters, 256 MiB
        layers: list[torch.nn.Module] = []
        for i in range(8):
            layers += [torch.nn.Linear(2048, 4096) if i % 2 == 0 else torch.nn.Linear(4096, 2048), torch.nn.ReLU()]
        model = torch.nn.Sequential(*layers).eval()
        batches = [(torch.randn(8, 2048),) for _ in range(4)]
        return model, batches[0], batches
    from transformers import BertConfig, BertModel

    from tests.support.hf_models import LastHiddenState

    bert = BertModel(BertConfig(vocab_size=8000, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                                intermediate_size=2048, max_position_embeddings=128), add_pooling_layer=False)
    model = LastHiddenState(bert, ("input_ids",)).eval()
    batches = [(torch.randint(0, 8000, (4, 64)),) for _ in range(4)]
    return model, batches[0], batches


def holdings(qmodel: torch.nn.Module) -> dict[str, float]:
    """What the converted model holds, seen from Python (MiB; sessions counted)."""
    from qplug_core.plugin_api import CompiledPartition
    from qplug_core.testing.held_tensors import reachable_tensors

    float_bytes = int8_bytes = 0
    for tensor in reachable_tensors(qmodel):
        size = tensor.untyped_storage().nbytes()
        if tensor.is_floating_point():
            float_bytes += size
        elif tensor.dtype in (torch.int8, torch.uint8):
            int8_bytes += size
    compiled = [m for m in qmodel.modules() if isinstance(m, CompiledPartition)]
    return {"float tensors": float_bytes / MIB, "int8 tensors": int8_bytes / MIB,
            # the sources kept in memory (a large one is kept in a temporary file instead)
            "onnx bytes": sum(len(s) for m in compiled for s in vars(m).get("_sources", {}).values()
                              if isinstance(s, bytes)) / MIB,
            "compiled": sum(len(m.compiled) for m in compiled)}


def run_case(model_name: str, backend: str, rounds: int, warm: bool) -> dict:
    import qplug_core as qp

    torch.set_num_threads(1)
    qp.get_backend(backend)  # the plugin and its runtime imported before the baseline
    if backend == "onnxruntime":
        import onnxruntime  # noqa: F401
    elif backend == "openvino":
        from qplug_openvino.runtime import import_openvino
        import_openvino()
    if warm:
        small = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16)).eval()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qp.quantize(small, (torch.randn(2, 16),), [(torch.randn(2, 16),)], backend=backend)(torch.randn(2, 16))
    base = rss_bytes()
    model, example, batches = build(model_name)
    float_rss = rss_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qmodel = qp.quantize(model, example, batches, backend=backend)
    with torch.no_grad():
        qmodel(*example)  # a first call: whatever a runtime allocates on first run
    converted_rss = rss_bytes()
    result = {"float": (float_rss - base) / MIB, "converted": (converted_rss - float_rss) / MIB,
              **holdings(qmodel)}
    if rounds:
        times = []
        with torch.no_grad():
            for _ in range(rounds):
                start = time.perf_counter()
                qmodel(*example)
                times.append(time.perf_counter() - start)
        result["ms"] = median(times) * 1e3
    del model, qmodel
    result["left"] = (rss_bytes() - base) / MIB
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "bert"], choices=["mlp", "bert"])
    parser.add_argument("--backends", nargs="+", default=["fbgemm", "onnxruntime", "openvino"])
    parser.add_argument("--latency", action="store_true", help="time each converted model (1 thread)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warm", action="store_true",
                        help="quantize a small model on the backend first: one-off process costs not counted")
    parser.add_argument("--case", nargs=2, metavar=("MODEL", "BACKEND"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(*args.case, args.rounds if args.latency else 0, args.warm)))
        return
    print(machine_line())
    rows = []
    for model_name in args.models:
        for backend in args.backends:
            command = [sys.executable, __file__, "--case", model_name, backend, "--rounds", str(args.rounds)]
            command += ["--latency"] if args.latency else []
            command += ["--warm"] if args.warm else []
            done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
            if done.returncode:
                print(f"{model_name} {backend} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
                continue
            r = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append([model_name, backend, f"{r['float']:.0f}", f"{r['converted']:.0f}",
                         f"{r['converted'] / r['float']:.2f}x", f"{r['left']:.0f}", f"{r['float tensors']:.0f}",
                         f"{r['int8 tensors']:.0f}", f"{r['onnx bytes']:.0f}", str(r["compiled"]),
                         f"{r['ms']:.2f}" if "ms" in r else "-"])
    print(table(["model", "backend", "float MiB", "converted MiB", "ratio", "left after del", "float tensors",
                 "int8 tensors", "ONNX bytes kept", "compiled", "ms (1 thread)"], rows))


if __name__ == "__main__":
    main()
