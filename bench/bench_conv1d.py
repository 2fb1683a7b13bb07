"""1-D conv models on fbgemm: float / int8 speed and accuracy (first-session reports, speech).

Run: ``taskset -c 0 python bench/bench_conv1d.py [--models tcn_pad tcn_chomp conformer cbr]
[--batches 1 4] [--rounds 20]``

A dilated causal TCN (6 blocks of two Conv1d(64, 64, k=3) with residual add+ReLU, length 2000) in its
two formulations: ``F.pad(x, (pad, 0))`` before the conv, and the classic padded conv with the tail
chomped (``[..., :-pad]``); a 2-block Conformer (d=144, depthwise Conv1d k=15, 200 frames); a
Conv1d+BN+ReLU stack (64 ch, length 1000). Each model is quantized with ``qp.quantize(...,
backend="fbgemm")`` (8 calibration batches of 4) and timed against float, 1 thread, interleaved;
the table shows float / int8 (above 1 means int8 is faster), held-out cosine and SQNR, and how
many compute ops the report leaves float. To see a change, run it in the old and the new tree.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _harness import interleaved, median, quiet, run_models
from torch import nn

import qplug_core as qp


class _CausalConv(nn.Module):
    def __init__(self, c: int, dilation: int, chomp: bool):
        super().__init__()
        self.pad, self.chomp = 2 * dilation, chomp
        self.conv = nn.Conv1d(c, c, 3, dilation=dilation, padding=self.pad if chomp else 0)

    def forward(self, x):
        if self.chomp:
            return self.conv(x)[..., :-self.pad]
        return self.conv(F.pad(x, (self.pad, 0)))


class _TCNBlock(nn.Module):
    def __init__(self, c: int, dilation: int, chomp: bool):
        super().__init__()
        self.c1, self.c2 = _CausalConv(c, dilation, chomp), _CausalConv(c, dilation, chomp)

    def forward(self, x):
        return F.relu(x + self.c2(F.relu(self.c1(x))))


def _tcn(chomp: bool) -> nn.Module:
    return nn.Sequential(nn.Conv1d(6, 64, 1), *[_TCNBlock(64, 2 ** i, chomp) for i in range(6)],
                         nn.Conv1d(64, 10, 1))


class _ConformerBlock(nn.Module):
    def __init__(self, d: int = 144, heads: int = 4, k: int = 15):
        super().__init__()
        self.ff1 = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.SiLU(), nn.Linear(4 * d, d))
        self.ln_att, self.att = nn.LayerNorm(d), nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln_conv, self.pw1 = nn.LayerNorm(d), nn.Conv1d(d, 2 * d, 1)
        self.dw, self.bn = nn.Conv1d(d, d, k, padding=k // 2, groups=d), nn.BatchNorm1d(d)
        self.pw2 = nn.Conv1d(d, d, 1)
        self.ff2 = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.SiLU(), nn.Linear(4 * d, d))
        self.ln_out = nn.LayerNorm(d)

    def forward(self, x):  # (B, T, d)
        x = x + 0.5 * self.ff1(x)
        h = self.ln_att(x)
        x = x + self.att(h, h, h, need_weights=False)[0]
        h = F.glu(self.pw1(self.ln_conv(x).transpose(1, 2)), dim=1)
        x = x + self.pw2(F.silu(self.bn(self.dw(h)))).transpose(1, 2)
        return self.ln_out(x + 0.5 * self.ff2(x))


class _Conformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.sub = nn.Sequential(nn.Conv1d(80, 144, 3, stride=2, padding=1), nn.ReLU())
        self.blocks = nn.Sequential(_ConformerBlock(), _ConformerBlock())

    def forward(self, mel):  # (B, 80, T)
        return self.blocks(self.sub(mel).transpose(1, 2))


def _cbr() -> nn.Module:
    layers: list[nn.Module] = []
    for cin in (6, 64, 64, 64):
        layers += [nn.Conv1d(cin, 64, 5, padding=2), nn.BatchNorm1d(64), nn.ReLU()]
    return nn.Sequential(*layers)


def _walk(batch: int, channels: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.cumsum(0.1 * torch.randn(batch, channels, length, generator=g), dim=-1)


MODELS = {  # name -> (builder, channels, length)
    "tcn_pad": (lambda: _tcn(chomp=False), 6, 2000),
    "tcn_chomp": (lambda: _tcn(chomp=True), 6, 2000),
    "conformer": (_Conformer, 80, 200),
    "cbr": (_cbr, 6, 1000),
}


def _float_ops(quantized: nn.Module) -> str:
    """The report's count of compute ops left in float (dequantize -> op -> quantize islands)."""
    line = str(qp.quantization_report(quantized)).splitlines()[1]  # "int8: N region(s), M compute op(s) ..."
    return line.split(", ", 1)[1].split(" compute")[0]


def run(name: str, batches: list[int], rounds: int) -> list[list[str]]:
    build, channels, length = MODELS[name]
    torch.manual_seed(0)
    model = build().eval()
    calibration = [(_walk(4, channels, length, seed),) for seed in range(1, 9)]
    with quiet():
        quantized = qp.quantize(model, (_walk(1, channels, length, 0),), calibration,
                                backend="fbgemm", progress=False)
    held_out = _walk(4, channels, length, 50)
    with torch.inference_mode():
        ref, out = model(held_out).double().flatten(), quantized(held_out).double().flatten()
    cosine = float(F.cosine_similarity(ref, out, dim=0))
    sqnr = float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))
    rows = []
    for batch in batches:
        x = held_out[:batch]
        with torch.inference_mode():
            times = interleaved({"float": lambda: model(x), "int8": lambda: quantized(x)}, rounds,
                                warmup=3)
        f, q = median(times["float"]), median(times["int8"])
        rows.append([name, str(batch), f"{f * 1e3:.2f}", f"{q * 1e3:.2f}", f"{f / q:.2f}x",
                     f"{cosine:.5f}", f"{sqnr:.1f}", _float_ops(quantized)])
    return rows


def main() -> None:
    run_models(__doc__, list(MODELS), run, ["model", "batch", "float ms", "int8 ms", "float/int8", "cosine",
                                            "SQNR dB", "float ops"])


if __name__ == "__main__":
    main()
