"""Issue 13: real Hugging Face transformers 5.x architectures quantize with the default options.

None of these traces symbolically (transformers 5 has no fx support); ``qp.quantize`` falls back
to torch.export by itself. Each model is built from its config with random weights
(``tests.support.hf_models``) and called with keyword inputs through a wrapper returning
``last_hidden_state``. Bar: >= 90% of the float model's matmul/conv FLOPs (FlopCounterMode,
attention included) run on int8 kernels, output cosine >= 0.999 on held-out inputs (one of them
with another batch size than the example: export keeps the batch dimension dynamic).
Measured (bench/bench_hf.py): shares 0.96-0.98, cosines 0.9994-1.0000.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qplug_core as qp
from tests.support.flops import int8_flop_share
from tests.support.hf_models import HF_MODELS, build_hf_model, hf_inputs

pytestmark = [pytest.mark.usefixtures("one_thread", "plugin_autoload"), pytest.mark.slow]

#: a projection of each architecture, by the name it has in the user's model
_PROJECTION = {
    "bert": "model.encoder.layer.0.attention.self.query",
    "gpt2": "model.h.0.attn.c_attn",  # transformers' Conv1D, lowered as a linear
    "vit": "model.embeddings.patch_embeddings.projection",  # the patch conv
    "wav2vec2": "model.encoder.pos_conv_embed.conv",  # weight-norm conv
    "whisper_encoder": "model.conv1",
    "t5_encoder": "model.encoder.block.0.layer.1.DenseReluDense.wi",  # fused with its relu
}


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_hf_model_quantizes_by_default(name):
    model = build_hf_model(name)
    example = hf_inputs(name, seed=0)
    calibration = [hf_inputs(name, seed=s) for s in range(1, 5)]
    held_out = [hf_inputs(name, seed=50), hf_inputs(name, batch=3, seed=51)]  # batch is dynamic

    quantized = qp.quantize(model, example, calibration, backend="fbgemm")

    report = qp.quantization_report(quantized)
    assert report.capture == "export"
    share = int8_flop_share(model, quantized, example)
    assert share.share >= 0.90, (share.int8, share.total, share.by_module)
    # kernels sit at the user's module paths: the float module of that name did the FLOPs
    assert share.by_module[_PROJECTION[name]] > 0
    with torch.no_grad():
        cosine = _cosine(torch.cat([model(*x).flatten() for x in held_out]),
                         torch.cat([quantized(*x).flatten() for x in held_out]))
    assert cosine >= 0.999
