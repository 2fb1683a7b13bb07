"""Peak memory of ``qp.quantize``: what a machine with little RAM hits is the peak, not the result.

Each case runs in a fresh subprocess: build the float model, take the resident size after a GC
(the baseline), run ``qp.quantize(model, example, 8 calibration batches, backend=...)`` and read
the process's peak RSS (``ru_maxrss``). The table gives peak minus baseline as a multiple of the
float model's bytes, and the same for each stage (RSS sampled every 5 ms by a thread while the
flow's stage functions, wrapped here, say which one runs; a stage inside another counts as its own).

Cases: a config-built BERT-base (``BertModel(BertConfig())``, ~110 M parameters, 1x128 tokens,
captured by torch.export) and an MLP of 12 4096x4096 linears (~800 MiB), symbolically traced and
exported.

    python bench/bench_quantize_memory.py [--cases bert mlp mlp-export] [--backend fbgemm]

Peak RSS counts freed memory glibc keeps in its heap (tensors below its dynamic mmap threshold, up to
32 MiB: BERT's); ``MALLOC_MMAP_THRESHOLD_=1048576`` in the environment shows the peak without most of it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import gc
import json
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

from _harness import machine_line, table

CASES = ("bert", "mlp", "mlp-export", "vit", "vit-large")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _trimmed_rss() -> int:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return _rss()


def _build(case: str):
    import torch
    from torch import nn

    torch.manual_seed(0)
    if case == "bert":
        from transformers import BertConfig, BertModel

        model = BertModel(BertConfig()).eval()
        batches = [(torch.randint(0, 30522, (1, 128)),) for _ in range(8)]
        return model, batches[0], batches, {}
    if case.startswith("vit"):  # ViT-B/16 (86 M parameters) or ViT-L/16 (304 M), 1x3x224x224
        from transformers import ViTConfig, ViTModel

        large = {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
                 "intermediate_size": 4096} if case == "vit-large" else {}
        model = ViTModel(ViTConfig(**large), add_pooling_layer=False).eval()
        batches = [(torch.randn(1, 3, 224, 224),) for _ in range(8)]
        return model, batches[0], batches, {}
    layers = [m for _ in range(12) for m in (nn.Linear(4096, 4096), nn.ReLU())]
    model = nn.Sequential(*layers).eval()
    batches = [(torch.randn(1, 4096),) for _ in range(8)]
    return model, batches[0], batches, {"capture": "export"} if case == "mlp-export" else {}


class _Stages:
    """Which wrapped stage function runs (innermost), and the peak RSS sampled in each."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.peaks: dict[str, int] = {}
        self.seconds: dict[str, float] = {}  # wall time in each stage, the stages inside it included
        self.order: list[str] = []
        self._stop = threading.Event()

    def wrap(self, owner: object, name: str, label: str) -> None:
        function = getattr(owner, name)

        @functools.wraps(function)
        def staged(*args, **kwargs):
            self.stack.append(label)
            if label not in self.order:
                self.order.append(label)
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start
                self.stack.pop()

        setattr(owner, name, staged)

    def sample(self) -> None:
        while not self._stop.wait(0.005):
            stage = self.stack[-1] if self.stack else "between stages"
            if stage not in self.order:
                self.order.append(stage)
            self.peaks[stage] = max(self.peaks.get(stage, 0), _rss())

    def __enter__(self) -> _Stages:
        self._thread = threading.Thread(target=self.sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _delegate_stages(backend: str) -> list[tuple[object, str, str]]:
    """The steps of a delegate's convert: partition export, the runtime's compile, the checks."""
    from qplug_core import onnx_export
    from qplug_core.flows import delegate, finish

    stages = [(finish, "delegate_graph", "delegate"), (delegate, "_inputs_of", "delegate: partition inputs"),
              (onnx_export, "to_onnx_proto", "delegate: ONNX export"),
              (delegate, "_checked", "delegate: convert-time check"),
              (delegate, "_wrong_regions", "delegate: region check"),
              (finish, "hold_reference_forms_as_int8", "hold forms as int8")]
    if backend == "onnxruntime":
        from qplug_onnxruntime.session import OrtPartition
        stages.append((OrtPartition, "build", "delegate: ORT session"))
    elif backend == "openvino":
        from qplug_openvino.compiled import OpenVinoPartition
        stages.append((OpenVinoPartition, "build", "delegate: OpenVINO compile"))
    return stages


def _child(case: str, backend: str) -> None:
    import warnings

    import torch

    import qplug_core as qp
    from qplug_core.algorithms import recipes, target
    from qplug_core.flows import steps

    torch.set_num_threads(1)
    model, example, batches, options = _build(case)
    float_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    stages = _Stages()
    for owner, name, label in [(steps, "fuse_model", "capture+fuse"), (steps, "prepare_fx", "prepare"),
                               (steps, "calibrate", "calibrate"), (steps, "convert_fx", "convert"),
                               (steps, "finish_conversion", "lower+check"),
                               (recipes, "copy_model", "copy model"),
                               (target, "layer_errors", "target: layer errors"),
                               (target, "score", "target: score"), *_delegate_stages(backend)]:
        stages.wrap(owner, name, label)
    reference = model(*example)
    del reference
    baseline = _trimmed_rss()
    start = time.perf_counter()
    with stages, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qmodel = qp.quantize(model, example, batches, backend=backend, progress=False, **options)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    kept = _trimmed_rss()
    print(json.dumps({"case": case, "float": float_bytes, "baseline": baseline, "peak": peak,
                      "kept": kept, "seconds": seconds, "capture": qmodel.meta.get("qplug_capture"),
                      "stages": [(s, stages.peaks.get(s, 0), stages.seconds.get(s, 0.0)) for s in stages.order]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--backend", default="fbgemm")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.backend)
        return
    print(machine_line())
    rows, stage_rows = [], []
    for case in args.cases:
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", case,
                               "--backend", args.backend], capture_output=True, text=True, check=False)
        if done.returncode:
            print(f"{case}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        mib, times = 2 ** 20, (lambda b: f"{(b - r['baseline']) / r['float']:.2f}x")
        rows.append([case, args.backend, r["capture"], f"{r['float'] / mib:.0f}", f"{(r['peak'] - r['baseline']) / mib:.0f}",
                     times(r["peak"]), times(r["kept"]), f"{r['seconds']:.0f}"])
        stage_rows += [[case, stage, times(peak), f"{seconds:.0f}"] for stage, peak, seconds in r["stages"] if peak]
    print(table(["case", "backend", "capture", "float MiB", "peak - base MiB", "peak - base", "kept - base", "s"], rows))
    print("peak RSS over the baseline while each stage ran, in float-model bytes:")
    print(table(["case", "stage", "peak - base", "s"], stage_rows))


if __name__ == "__main__":
    main()
