"""An export capture that fixes a size of 1 the example was widened along says so at quantize time
(``qplug_core/flows/capture.py``).

WavLM's relative position bias makes torch.export's graph at batch 2 refuse batch 1, so a batch-1
example kept the batch fixed at 1: ``qp.quantize`` said nothing and the first batch-3 call raised.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import InputMismatchError
from qplug_core.flows.capture import capture_for_quantization


class BatchAsNumber(nn.Module):
    """Reads the batch into a Python int: every export fixes it at the example's."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x):
        batch = int(x.shape[0])
        return self.fc(x).view(batch, 2, 4)


class BatchAsSize(BatchAsNumber):
    """The same view with the batch as a size: export keeps it dynamic."""

    def forward(self, x):
        return self.fc(x).view(x.shape[0], 2, 4)


def _said(run) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run()
    return result, [str(w.message) for w in caught if "at the example's size 1" in str(w.message)]


def test_a_batch_the_model_reads_as_a_number_is_named_at_quantize_time():
    torch.manual_seed(0)
    model = BatchAsNumber().eval()
    data = [torch.randn(1, 16) for _ in range(2)]
    qmodel, said = _said(lambda: qp.quantize(model, data[0], data, backend="reference", capture="export",
                                                     recipe="none", progress=False))
    assert len(said) == 1
    assert said[0].startswith("qplug: BatchAsNumber: torch.export fixes dim 0 (the batch) of input 'x' at the "
                              "example's size 1, so the quantized model takes size 1 only there: the graph "
                              "exported at size 2 refuses the example's sizes")
    with pytest.raises(InputMismatchError, match="'x' has size 3 at dim 0"):  # what the warning announced
        qmodel(torch.randn(3, 16))


def test_a_batch_kept_dynamic_says_nothing():
    gm, said = _said(lambda: capture_for_quantization(BatchAsSize().eval(), (torch.randn(1, 16),), level="export"))
    assert said == []
    assert gm(torch.randn(3, 16)).shape == (3, 2, 4)


@pytest.mark.slow  # two exports of a tiny WavLM: 10-20 s on the shared machine
def test_wavlm_from_a_batch_1_example_says_its_batch_is_fixed():
    transformers = pytest.importorskip("transformers")
    config = transformers.WavLMConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=64, conv_dim=(16, 16), conv_kernel=(10, 3),
                                      conv_stride=(5, 2), num_conv_pos_embeddings=8,
                                      num_conv_pos_embedding_groups=2, num_buckets=16, max_bucket_distance=20)
    torch.manual_seed(0)
    model = transformers.WavLMModel(config).eval()
    _, said = _said(lambda: capture_for_quantization(model, (torch.randn(1, 1600),)))
    assert len(said) == 1
    assert "WavLMModel: torch.export fixes dim 0 (the batch) of input 'input_values'" in said[0]
    assert "refuses the example's sizes (AssertionError: Guard failed" in said[0]
