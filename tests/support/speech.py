"""Speech-like test audio: voiced segments with silences between them.

White noise (what :data:`tests.support.hf_models.HF_MODELS` feeds Wav2Vec2) has no quiet frames,
and quiet frames are where a per-tensor activation scale fails a raw-waveform front end whose
features are normalised per frame; this signal has them, as real utterances do.
"""

from __future__ import annotations

import math

import torch

__all__ = ["speech_with_silences"]

SAMPLE_RATE = 16_000


def speech_with_silences(seconds: float, gen: torch.Generator) -> torch.Tensor:
    """A 1-D waveform, peak 0.5: about 70% of 0.08-0.4 s segments voiced (24 harmonics of a
    100-250 Hz pitch under a Hann window), gaps of up to 0.15 s, and 0.01 white noise throughout."""
    n = int(seconds * SAMPLE_RATE)
    wave = torch.zeros(n)
    pos = 0
    while pos < n:
        seg = int((0.08 + 0.32 * torch.rand((), generator=gen).item()) * SAMPLE_RATE)
        if torch.rand((), generator=gen).item() < 0.7:
            pitch = 100 + 150 * torch.rand((), generator=gen).item()
            decay = 3 + 7 * torch.rand((), generator=gen).item()
            phase = 2 * math.pi * pitch * torch.arange(seg) / SAMPLE_RATE
            voiced = sum(torch.sin(k * phase) * math.exp(-k / decay) / math.sqrt(k) for k in range(1, 25))
            wave[pos:pos + seg] = (voiced * torch.hann_window(seg))[: n - pos]
        pos += seg + int(0.15 * torch.rand((), generator=gen).item() * SAMPLE_RATE)
    wave += 0.01 * torch.randn(n, generator=gen)
    return wave / wave.abs().max() * 0.5
