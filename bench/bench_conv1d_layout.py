"""Float islands between int8 Conv1d on fbgemm: boundaries keeping the conv layout vs contiguous.

Run: ``taskset -c 0 python bench/bench_conv1d_layout.py [--batches 1 4] [--rounds 20]``

A Wav2Vec2-style feature extractor (7 Conv1d(128, 128) with Wav2Vec2's kernels and strides, GELU
between them, 1 s of 16 kHz audio) and a Conv1d -> SiLU -> Conv1d stack (64 ch, length 2000) are
quantized once with ``qp.quantize(..., backend="fbgemm")``; the same int8 model is then timed with
the island boundaries keeping the Conv1d layout ("kept", what lowering sets) and with every
boundary making its tensor contiguous ("contiguous", as before), interleaved, 1 thread. The table
shows contiguous / kept (above 1 means keeping the layout is faster) and whether the outputs are
bit-identical.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _harness import interleaved, median, quiet, run_models
from torch import nn

import qplug_core as qp
from qplug_core.kernels.boundary import Dequantize, Quantize


class _Extractor(nn.Module):
    """Wav2Vec2's conv feature extractor without its first GroupNorm: conv -> GELU, 7 times."""

    def __init__(self, c: int = 128):
        super().__init__()
        shapes = [(10, 5)] + [(3, 2)] * 4 + [(2, 2)] * 2
        self.convs = nn.ModuleList(nn.Conv1d(1 if i == 0 else c, c, k, stride=s) for i, (k, s) in enumerate(shapes))

    def forward(self, x):
        for conv in self.convs:
            x = F.gelu(conv(x))
        return x


class _SiluStack(nn.Module):
    def __init__(self, c: int = 64):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv1d(c, c, 3, padding=1) for _ in range(4))

    def forward(self, x):
        for conv in self.convs:
            x = F.silu(conv(x))
        return x


MODELS = {"extractor": (_Extractor, 1, 16000), "silu_stack": (_SiluStack, 64, 2000)}


def _boundaries(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m) in (Dequantize, Quantize) and m.keep_conv1d_layout]


def run(name: str, batches: list[int], rounds: int) -> list[list[str]]:
    build, channels, length = MODELS[name]
    torch.manual_seed(0)
    model = build().eval()
    data = [(torch.randn(4, channels, length),) for _ in range(4)]
    with quiet():
        quantized = qp.quantize(model, data[0], data, backend="fbgemm", progress=False)
    kept = _boundaries(quantized)

    def layout(keep: bool):
        for module in kept:
            module.keep_conv1d_layout = keep

    rows = []
    for batch in batches:
        x = data[1][0][:batch]
        with torch.inference_mode():
            layout(False)
            before = quantized(x)
            layout(True)
            identical = torch.equal(before, quantized(x))
            times = interleaved({"contiguous": lambda: (layout(False), quantized(x)),
                                 "kept": lambda: (layout(True), quantized(x))}, rounds, warmup=3)
        c, k = median(times["contiguous"]), median(times["kept"])
        rows.append([name, str(batch), str(len(kept)), f"{c * 1e3:.2f}", f"{k * 1e3:.2f}", f"{c / k:.2f}x",
                     str(identical)])
    return rows


def main() -> None:
    run_models(__doc__, list(MODELS), run, ["model", "batch", "boundaries kept", "contiguous ms", "kept ms",
                                            "contiguous/kept", "identical"])


if __name__ == "__main__":
    main()
