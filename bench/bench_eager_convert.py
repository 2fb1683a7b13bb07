"""``qp.eager.convert`` time of an eager MobileNetV2 (the zoo's, with stubs and FloatFunctional
residual adds; conv-bn fused), this checkout vs an older qplug_core tree: what convert's kernel
check (``qplug_core/eager/kernel_check.py``) costs.

Each tree runs in its own subprocess (two versions of qplug_core cannot share a process),
alternating in rotating order so machine noise hits both alike. Each child prepares and
calibrates once (2 batches of 4x3x224x224, 1 thread), converts once to warm up, then times
``--converts`` converts and reports the median; a child whose tree has the check also times
convert with the check replaced by a no-op, interleaved, which splits the added time between the
check itself and building each module's reference computation.

    git archive <commit> qplug_core | tar -x -C /tmp/before
    python bench/bench_eager_convert.py --before /tmp/before [--rounds 3] [--converts 3] [--backend qnnpack]
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PLUGINS = [REPO / "plugins" / name for name in ("qplug_fbgemm", "qplug_qnnpack", "qplug_onnxruntime",
                                                 "qplug_openvino")]


def eager_mobilenet_parts(functional):
    """The zoo's MobileNetV2 in eager form, residual adds through ``functional()`` (qplug's or
    torch.ao's FloatFunctional class), and its conv-bn fusion groups (ReLU6 stays a module)."""
    import torch

    from qplug_core.zoo.mobilenet import Conv2dNormActivation, InvertedResidual, mobilenet_v2

    class EagerInvertedResidual(InvertedResidual):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.skip.add(x, self.conv(x)) if self.use_res_connect else self.conv(x)

    torch.manual_seed(0)
    model = mobilenet_v2().eval()
    groups = []
    for name, module in model.named_modules():
        if isinstance(module, InvertedResidual):
            module.__class__ = EagerInvertedResidual
            if module.use_res_connect:
                module.skip = functional()
            last = len(module.conv) - 2  # the projection conv, then its BatchNorm
            groups.append([f"{name}.conv.{last}", f"{name}.conv.{last + 1}"])
        elif isinstance(module, Conv2dNormActivation):
            groups.append([f"{name}.0", f"{name}.1"])
    return model, groups


def eager_mobilenet():
    """The zoo's MobileNetV2 in eager form: QuantWrapper, residual adds through FloatFunctional,
    conv-bn fused (ReLU6 stays a module)."""
    from torch import nn

    import qplug_core as qp
    from qplug_core.eager import FloatFunctional, QuantWrapper

    model, groups = eager_mobilenet_parts(FloatFunctional)
    return qp.eager.fuse_modules(QuantWrapper(model).eval(), [[f"module.{m}" for m in g] for g in groups]), nn


def child(backend: str, converts: int) -> None:
    import torch

    torch.set_num_threads(1)
    import qplug_core as qp
    eager_convert = importlib.import_module("qplug_core.eager.convert")  # qp.eager.convert is the function

    model, _ = eager_mobilenet()
    observed = qp.eager.prepare(model, backend=backend)
    with torch.no_grad():
        for seed in range(2):
            observed(torch.randn(4, 3, 224, 224, generator=torch.Generator().manual_seed(seed)))
    qp.eager.convert(observed)  # warm-up: plugins, engine probes
    check = getattr(eager_convert, "check_kernels", None)

    def unchecked() -> None:
        eager_convert.check_kernels = lambda *args, **kwargs: None
        try:
            qp.eager.convert(observed)
        finally:
            eager_convert.check_kernels = check

    variants = {"convert": lambda: qp.eager.convert(observed)}
    if check is not None:
        variants["convert, check a no-op"] = unchecked
    sys.path.insert(0, str(REPO / "bench"))
    from _harness import interleaved

    samples = interleaved(variants, converts)
    print(json.dumps({"core": qp.__file__, **{name: statistics.median(s) for name, s in samples.items()}}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", type=Path, help="directory holding an older qplug_core/ (required)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--converts", type=int, default=3)
    parser.add_argument("--backend", default="qnnpack")
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    if args.child:
        return child(args.backend, args.converts)
    if args.before is None:
        parser.error("--before DIR is required")
    sys.path.insert(0, str(REPO / "bench"))
    from _harness import json_child, machine_line

    print(machine_line())
    variants = {"before": args.before, "after": None}
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for r in range(args.rounds):
        order = list(variants)[r % 2:] + list(variants)[:r % 2]
        for name in order:
            results[name].append(json_child(__file__, [variants[name] or REPO, *PLUGINS], "--child",
                                            "--backend", args.backend, "--converts", str(args.converts)))
    medians = {}
    for name, rounds in results.items():
        for key in [k for k in rounds[0] if k != "core"]:
            values = [r[key] for r in rounds]
            medians[f"{name}: {key}"] = statistics.median(values)
            print(f"{name:6s} {key:24s} median {statistics.median(values) * 1e3:8.1f} ms  "
                  f"(per-round medians {', '.join(f'{v * 1e3:.0f}' for v in values)})")
    before = medians["before: convert"]
    print(f"after / before: {medians['after: convert'] / before:.3f}; after with the check a no-op / before: "
          f"{medians['after: convert, check a no-op'] / before:.3f}")


if __name__ == "__main__":
    main()
