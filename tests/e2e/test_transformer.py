"""Issue 6, graph mode: a BERT-style encoder with BERT's -10000 additive attention mask.

make_realistic_bert carries trained BERT's outlier channels (every LayerNorm scales two hidden dims by
4x), the inputs are masked batches (odd rows end in padding). qplug's default static config keeps
the projections int8 and leaves layer norm, softmax and the mask add in float, each with a reason in
the report; the output embedding stays within cosine 0.999 of float (issue bar: 0.98; measured
0.99999, 46 dB).

torch.ao's default static mapping on the same model and inputs is run for comparison only and its
cosine recorded (user property ``torch_ao_cosine``; measured 0.9982, 24 dB): it quantizes the
-10000 mask add, softmax and layer norms too. Only ``qplug >= torch.ao`` is asserted.
"""

from __future__ import annotations

import copy
import operator
import warnings

import pytest
import torch
import torch.nn.functional as F

import qplug_core as qp
from qplug_core.zoo import example_inputs
from qplug_core.zoo.transformer import make_realistic_bert

pytestmark = pytest.mark.usefixtures("one_thread")


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


@pytest.fixture(scope="module")
def encoder():
    model = make_realistic_bert(seed=0)
    calibration = [example_inputs("bert_encoder", batch=8, seed=s) for s in range(1, 4)]
    held_out = [example_inputs("bert_encoder", batch=8, seed=s) for s in (50, 51)]
    for _, mask in held_out:
        assert (mask == 0).any() and (mask == 1).all(dim=1).any()  # padded and unpadded rows
    with torch.no_grad():
        expected = torch.cat([model(*batch) for batch in held_out])
    return model, calibration, held_out, expected


@pytest.fixture(scope="module")
def quantized(encoder):
    model, calibration, _, _ = encoder
    return qp.quantize(model, calibration[0], calibration, backend="reference")


def _run(model, batches) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(*batch) for batch in batches])


def test_default_static_config_keeps_cosine(encoder, quantized):
    _, _, held_out, expected = encoder
    assert _cosine(expected, _run(quantized, held_out)) >= 0.999
    report = qp.quantization_report(quantized)
    projections = [n for n in report.quantized if n.endswith(("query", "key", "value", "dense"))]
    assert len(projections) == 12  # 2 layers x (q, k, v, attention out, intermediate, output)


def _mask_adds(gm) -> list:
    """The adds of the -10000 mask bias: the inputs of every softmax."""
    adds = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.softmax:
            source = node.args[0]
            assert source.op == "call_function" and source.target is operator.add
            adds.append(source.name)
    return adds


def test_report_lists_float_ops_with_reasons(quantized):
    report = qp.quantization_report(quantized)
    skipped = {s.node: s for s in report.skipped}
    assert all(s.reason for s in report.skipped)

    norms = [s for s in report.skipped if s.op == "LayerNorm"]
    assert len(norms) == 5  # embeddings + 2 per layer
    assert all("qconfig is None" in s.reason for s in norms)

    softmaxes = [s for s in report.skipped if s.op == "softmax"]
    assert len(softmaxes) == 2 and all(s.reason for s in softmaxes)

    mask_adds = _mask_adds(quantized)
    assert len(mask_adds) == 2
    for name in mask_adds:
        assert name in skipped and skipped[name].op == "add"
        assert "kept float" in skipped[name].reason
    # the -10000 bias itself is built in float too: its source is the mask, (1 - mask) * -10000
    assert any(s.op == "mul" for s in report.skipped)


def test_torch_ao_default_static_mapping_for_comparison(encoder, quantized, record_property):
    tq = pytest.importorskip("torch.ao.quantization")
    quantize_fx = pytest.importorskip("torch.ao.quantization.quantize_fx")
    model, calibration, held_out, expected = encoder
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = "fbgemm"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            observed = quantize_fx.prepare_fx(copy.deepcopy(model), tq.get_default_qconfig_mapping("fbgemm"),
                                              calibration[0])
            with torch.no_grad():
                for batch in calibration:
                    observed(*batch)
            theirs = _cosine(expected, _run(quantize_fx.convert_to_reference_fx(observed), held_out))
    finally:
        torch.backends.quantized.engine = previous
    ours = _cosine(expected, _run(quantized, held_out))
    record_property("torch_ao_cosine", theirs)
    record_property("qplug_cosine", ours)
    print(f"\ncosine vs float: qplug {ours:.6f}, torch.ao default static {theirs:.6f}")
    # torch.ao's figure is recorded, not judged against a bar (see module docstring); keeping the
    # mask add, softmax and layer norms float must not make qplug worse than quantizing them
    assert ours >= theirs
