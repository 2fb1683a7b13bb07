"""A batch-1 example is exported at batch 2, and kept where the graph answers the example as the
model does, judged without torch.export's guards on size relations, which qplug's graph does not
keep (``qplug_core/ir/capture.py``); otherwise the sizes of 1 it fixes are named at quantize time
(``qplug_core/flows/capture.py``).

WavLM's batch-2 graph guards ``batch * frames != frames``, so a batch-1 example kept the batch fixed
at 1: ``qp.quantize`` said nothing and the first batch-3 call raised.
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
def test_wavlm_from_a_batch_1_example_takes_other_batches():
    """The graph exported at batch 2 guards ``batch * frames != frames`` (WavLM's relative position
    bias reads the batch), which refused batch 1: the example's sizes were exported, fixing batch 1."""
    transformers = pytest.importorskip("transformers")
    config = transformers.WavLMConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=64, conv_dim=(16, 16), conv_kernel=(10, 3),
                                      conv_stride=(5, 2), num_conv_pos_embeddings=8,
                                      num_conv_pos_embedding_groups=2, num_buckets=16, max_bucket_distance=20)
    torch.manual_seed(0)
    model = transformers.WavLMModel(config).eval()
    gm, said = _said(lambda: capture_for_quantization(model, (torch.randn(1, 1600),)))
    assert said == []
    with torch.no_grad():
        for x in (torch.randn(3, 1600), torch.randn(1, 2000)):
            got = gm(x)
            got = got[0] if isinstance(got, (tuple, list)) else got.last_hidden_state
            assert torch.allclose(got, model(x).last_hidden_state, atol=1e-5)
