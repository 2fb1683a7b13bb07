"""Per-call cost of the Python layers qplug's eager convert adds, against torch.ao's eager convert.

Run: ``taskset -c 1 python bench/bench_eager_call_overhead.py [--models cnn upsample ...] [--rounds 30]``

Each model is built once with torch.ao's stubs and FloatFunctional (qplug's prepare adopts them),
fused alike, calibrated on the same batches and converted for fbgemm by ``qp.eager.convert`` and by
``torch.ao.quantization.convert`` (the floor: torch's own eager int8 modules). qplug's model is
timed as converted and with each kind of per-call layer it added stripped (found by the hook or
wrapper function's name, so the script also runs against an older tree): the instance ``forward``
wrappers naming a failed layer on each swapped layer (before session 30), the pre-hooks giving
pooling / upsampling modules a dense batch stride, the root's engine-pin hooks (before session 30)
or the wrapper of the model's call pinning the engine and naming a failed layer, and all of them
("bare"). Batch 1, 1 thread, interleaved in rotating order, CPU time (``time.process_time``);
medians in us per call and ratios to torch.ao.
"""

from __future__ import annotations

import argparse
import copy
import functools
import time

import torch
from _harness import interleaved, machine_line, median, quiet, table, torch_ao
from bench_eager_convert import eager_mobilenet_parts
from torch import nn

import qplug_core as qp
from qplug_core.zoo.digits import DigitsCNN
from qplug_core.zoo.resnet import BasicBlock, resnet18

#: per-call layers qplug may add, by the name of the function the hook or wrapper calls
LAYERS = {"layer names": ("_named_forward",), "restride": ("_dense_batch_stride_input",),
          "engine pin": ("_EnterEngine", "_leave_engine"), "model call (engine, names)": ("_model_call",)}


class SmallCNN(nn.Module):
    """conv-relu-pool, conv-relu, global pool, linear (3x32x32)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.relu1, self.pool = nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)
        self.conv2, self.relu2 = nn.Conv2d(16, 32, 3, padding=1), nn.ReLU()
        self.gap, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gap(self.relu2(self.conv2(self.pool(self.relu1(self.conv1(x))))))
        return self.fc(torch.flatten(x, 1))


class UpsampleNet(nn.Module):
    """conv-relu, nn.Upsample x2 (nearest), conv-relu, nn.Upsample (bilinear), conv (3x16x16)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.relu1 = nn.Conv2d(3, 16, 3, padding=1), nn.ReLU()
        self.up1 = nn.Upsample(scale_factor=2.0, mode="nearest")
        self.conv2, self.relu2 = nn.Conv2d(16, 16, 3, padding=1), nn.ReLU()
        self.up2 = nn.Upsample(scale_factor=2.0, mode="bilinear", align_corners=False)
        self.conv3 = nn.Conv2d(16, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv3(self.up2(self.relu2(self.conv2(self.up1(self.relu1(self.conv1(x)))))))


class TokensToMap(nn.Module):
    """A linear over tokens reshaped into a map and upsampled (SegFormer's decoder; 16x8x8): the
    batch-1 view the restride hook is there for."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.fuse = nn.Linear(16, 16), nn.Conv2d(16, 8, 1)
        self.resize = nn.Upsample(scale_factor=2.0, mode="bilinear", align_corners=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.proj(x.flatten(2).transpose(1, 2))
        return self.fuse(self.resize(tokens.transpose(1, 2).reshape(x.shape[0], -1, x.shape[2], x.shape[3])))


class EagerDigits(DigitsCNN):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = self.relu1(self.bn1(self.conv1(x)))
        x = self.skip.add_relu(self.bn2(self.conv2(identity)), identity)
        x = self.relu3(self.bn3(self.conv3(self.pool(x))))
        return self.fc(torch.flatten(x, 1))


class EagerBasicBlock(BasicBlock):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x)))))
        return self.skip.add_relu(out, identity)


def _digits(functional: type[nn.Module]) -> tuple[nn.Module, list[list[str]]]:
    model = DigitsCNN()
    model.__class__, model.skip = EagerDigits, functional()
    return model, [["conv1", "bn1", "relu1"], ["conv2", "bn2"], ["conv3", "bn3", "relu3"]]


def _resnet(functional: type[nn.Module]) -> tuple[nn.Module, list[list[str]]]:
    model, groups = resnet18(), [["conv1", "bn1", "relu"]]
    for name, module in model.named_modules():
        if isinstance(module, BasicBlock):
            module.__class__, module.skip, module.relu1 = EagerBasicBlock, functional(), nn.ReLU()
            groups += [[f"{name}.conv1", f"{name}.bn1", f"{name}.relu1"], [f"{name}.conv2", f"{name}.bn2"]]
            if module.downsample is not None:
                groups.append([f"{name}.downsample.0", f"{name}.downsample.1"])
    return model, groups


#: name -> (builder of (float model, fusion groups), input shape at batch 1)
MODELS = {
    "cnn": (lambda functional: (SmallCNN(), []), (1, 3, 32, 32)),
    "upsample": (lambda functional: (UpsampleNet(), []), (1, 3, 16, 16)),
    "tokens_upsample": (lambda functional: (TokensToMap(), []), (1, 16, 8, 8)),
    "digits_cnn": (_digits, (1, 1, 8, 8)),
    "resnet18": (_resnet, (1, 3, 64, 64)),
    "mobilenet_v2": (eager_mobilenet_parts, (1, 3, 64, 64)),
}


def _made_by(fn: object) -> str:
    fn = fn.func if isinstance(fn, functools.partial) else fn
    return getattr(fn, "__name__", type(fn).__name__)


def _stripped(model: nn.Module, names: tuple[str, ...]) -> nn.Module:
    """A copy of ``model`` without the hooks and instance forwards made by functions called ``names``."""
    copied = copy.deepcopy(model)
    for module in copied.modules():
        if "forward" in vars(module) and _made_by(module.forward) in names:
            del module.forward
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key in [k for k, h in hooks.items() if _made_by(h) in names]:
                del hooks[key]
    return copied


def _count(model: nn.Module, names: tuple[str, ...]) -> int:
    return sum(("forward" in vars(m) and _made_by(m.forward) in names)
               + sum(_made_by(h) in names for h in [*m._forward_pre_hooks.values(), *m._forward_hooks.values()])
               for m in model.modules())


def _converted(name: str, tq) -> tuple[nn.Module, nn.Module, tuple[int, ...]]:
    build, shape = MODELS[name]
    torch.manual_seed(0)
    from torch.ao.nn.quantized import FloatFunctional  # torch.ao's, which qplug's prepare adopts

    model, groups = build(FloatFunctional)
    model = tq.QuantWrapper(model.eval()).eval()
    groups = [[f"module.{m}" for m in g] for g in groups]
    calibration = [torch.randn(4, *shape[1:], generator=torch.Generator().manual_seed(s)) for s in range(2)]
    with quiet(), torch.no_grad():
        ours = qp.eager.prepare(qp.eager.fuse_modules(copy.deepcopy(model), groups) if groups else
                                copy.deepcopy(model), backend="fbgemm")
        theirs = tq.fuse_modules(copy.deepcopy(model), groups) if groups else copy.deepcopy(model)
        theirs.qconfig = tq.get_default_qconfig("fbgemm")
        theirs = tq.prepare(theirs)
        for x in calibration:
            ours(x)
            theirs(x)
        return qp.eager.convert(ours), tq.convert(theirs), shape


def run(name: str, rounds: int, inner: int) -> list[list[str]]:
    tq = torch_ao()
    torch.backends.quantized.engine = "fbgemm"
    ours, theirs, shape = _converted(name, tq)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(7))
    variants = {"torch.ao": theirs, "qplug": ours}
    counts = {}
    for layer, made_by in LAYERS.items():
        counts[layer] = _count(ours, made_by)
        if counts[layer]:
            variants[f"qplug without {layer}"] = _stripped(ours, made_by)
    variants["qplug bare"] = _stripped(ours, tuple(n for names in LAYERS.values() for n in names))
    with torch.no_grad():
        calls = {v: functools.partial(m, x) for v, m in variants.items()}
        samples = interleaved(calls, rounds, inner=inner, clock=time.process_time)
    floor = median(samples["torch.ao"])
    added = ", ".join(f"{layer} {n}" for layer, n in counts.items() if n)
    return [[f"{name} ({added or 'none'})" if v == "torch.ao" else "", v, f"{median(s) * 1e6:.1f}",
             f"{median(s) / floor:.3f}"] for v, s in samples.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--inner", type=int, default=50, help="calls per sample")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(machine_line())
    rows = [row for name in args.models for row in run(name, args.rounds, args.inner)]
    print(table(["model (per-call layers qplug added)", "variant", "us/call", "/ torch.ao"], rows))


if __name__ == "__main__":
    main()
