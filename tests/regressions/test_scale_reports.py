"""Reports from quantizing large models (0.5-1.1B decoders, BERT-large, ViT-L), reproduced small."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

import qplug_core as qp
from qplug_core.testing import all_plugins_loaded, one_thread

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.slow  # ~14 s: two torch.export captures of a 1-layer BERT
def test_the_readme_compare_line_runs_on_a_hugging_face_model():
    """README's `qp.compare(qp.fuse_fx(model, backend=...), qmodel, example)` raised TraceError on
    every model qp.quantize captured with torch.export; `qp.compare(model, ...)` worked."""
    from transformers import BertConfig, BertModel

    (line,) = [line for line in README.read_text().splitlines() if line.startswith("print(qp.compare(")]
    call = re.match(r"print\((.*)\)\s+#", line).group(1)
    torch.manual_seed(0)
    model = BertModel(BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                 intermediate_size=64, vocab_size=100)).eval()
    example = (torch.randint(0, 100, (1, 8)),)
    with one_thread(), all_plugins_loaded(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qmodel = qp.quantize(model, example, [example], backend="fbgemm", progress=False)
        report = eval(call, {"qp": qp, "model": model, "qmodel": qmodel, "example": example})
    assert "encoder.layer.0.attention.self.query" in {layer.name for layer in report.layers}
    assert not report.float_only and report.output_sqnr_db > 20
