"""Defects an exploratory session on decoder LLMs found (s19/llm): each test is the user's own call,
with the numbers or the error a user relies on."""

from __future__ import annotations

import copy

import pytest
import torch

import qplug_core as qp
from qplug_core.errors import ConfigValidationError, ModelStateError, SerializationError
from tests.unit.weight_only.test_w8a8 import PROMPTS, decoder

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


def biased_qwen2(seed: int):
    """A Qwen2 decoder whose q/k/v biases are not zero, as a trained one's are."""
    model = decoder("qwen2", seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.bias"):
                p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("kernel", ["torch-int8pack", "reference"])
@pytest.mark.parametrize("assign", [False, True])
def test_load_state_dict_into_a_weight_only_model_computes_with_the_loaded_weights(kernel, assign):
    """A checkpoint of a quantized model loads into one rebuilt from other weights: it then computes
    what the saved one does (before: the packed weights, fused q/k/v stacks and stacked biases kept
    the old values, logits off by 0.9-1.1)."""
    target = qp.quantize_weights(biased_qwen2(0), bits=8, kernel=kernel)
    source = qp.quantize_weights(biased_qwen2(1), bits=8, kernel=kernel)
    assert target.qplug_weight_only.fused  # the fused groups are covered too
    target.load_state_dict(source.state_dict(), assign=assign)
    with torch.no_grad():
        torch.testing.assert_close(target(PROMPTS[0]).logits, source(PROMPTS[0]).logits, rtol=1e-5, atol=1e-5)


def test_an_in_place_edit_of_a_fused_members_bias_changes_its_output():
    qmodel = qp.quantize_weights(biased_qwen2(0), bits=8, kernel="reference")
    attention = qmodel.model.layers[0].self_attn
    assert attention.q_proj.fused is not None
    x = torch.randn(1, 3, attention.q_proj.in_features)
    with torch.no_grad():
        before = [attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)]
        attention.v_proj.bias.add_(10.0)
        attention.q_proj.qweight.zero_()
        after = [attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)]
    edited = attention.q_proj.quantized_weight().dequantize()
    assert not torch.equal(after[0], before[0])
    torch.testing.assert_close(after[0], x @ edited.T + attention.q_proj.bias)
    assert torch.equal(after[1], before[1])
    torch.testing.assert_close(after[2], before[2] + 10.0)


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                      bos_token_id=0, eos_token_id=0)).eval()


@pytest.mark.parametrize(("family", "dtype"), [("llama", torch.bfloat16), ("llama", torch.float16),
                                               ("gpt2", torch.bfloat16)])
def test_awq_keeps_a_half_precision_models_dtype(family, dtype):
    """As RTN and GPTQ do (before: Llama's logits came out float32 from the first AWQ layer on, and
    GPT-2 raised torch's 'self and mat2 must have the same dtype')."""
    model = (tiny_gpt2() if family == "gpt2" else decoder()).to(dtype)
    calibration = [torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    awq = qp.quantize_weights(model, bits=4, group_size=32, algorithm="awq", calibration_data=calibration,
                              kernel="reference")
    with torch.no_grad():
        want, got = model(PROMPTS[0]).logits, awq(PROMPTS[0]).logits
    assert got.dtype == dtype
    assert {awq.get_submodule(name).input_scale.dtype for name in awq.qplug_weight_only.kernels} == {dtype}
    assert float(torch.nn.functional.cosine_similarity(got.float().flatten(), want.float().flatten(), dim=0)) > 0.97


def test_a_w8a8_file_of_an_untied_head_is_refused_by_a_model_that_ties_it(tmp_path):
    """Before: it loaded without a word and the logits were off by 2.1 (one float table overwrote
    the other); a model with the saved config loads it and answers as the saved one."""
    model = decoder()
    calibration = [torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    qmodel = qp.quantize_w8a8(model, calibration)
    path = qp.save(qmodel, tmp_path / "w8a8.safetensors")
    tied_config = copy.deepcopy(model.config)
    tied_config.tie_word_embeddings = True
    tied = type(model)(tied_config).eval()
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    with pytest.raises(SerializationError, match=r"holds model\.embed_tokens\.weight and lm_head\.weight as one "
                                                 r"shared tensor.*tie_word_embeddings=False"):
        qp.load(path, model=tied)
    loaded = qp.load(path, model=decoder(seed=5))
    with torch.no_grad():
        assert torch.equal(loaded(PROMPTS[0]).logits, qmodel(PROMPTS[0]).logits)


def test_gemmas_scaled_embedding_is_listed_as_left_float_with_its_reason():
    """Before: with embeddings=True it stayed float without a word (not in .layers nor .skipped)."""
    model = decoder("gemma")
    qmodel = qp.quantize_weights(model, bits=8, embeddings=True, kernel="reference")
    info = qmodel.qplug_weight_only
    assert "model.embed_tokens" not in info.layers
    assert info.skipped["model.embed_tokens"] == ("GemmaTextScaledWordEmbedding subclasses Embedding and may compute "
                                                  "more in its own forward, which the quantized module would not run")
    with torch.no_grad():  # left float, so still scaled by sqrt(hidden_size)
        assert torch.equal(qmodel.model.embed_tokens(PROMPTS[0]), model.model.embed_tokens(PROMPTS[0]))


def test_a_linear_subclass_is_listed_as_left_float_with_its_reason():
    class ScaledLinear(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    model = torch.nn.Sequential(torch.nn.Linear(32, 32), ScaledLinear(32, 32))
    info = qp.quantize_weights(model, bits=8, kernel="reference").qplug_weight_only
    assert list(info.layers) == ["0"]
    assert info.skipped == {"1": "ScaledLinear subclasses Linear and may compute more in its own forward, which "
                                 "the quantized module would not run"}


@pytest.mark.parametrize("mode", ["weight-only", "w8a8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_casting_a_quantized_model_to_half_precision_raises_a_qplug_error_saying_what_to_do(mode, dtype):
    """Before: the weight-only model computed in float32 without a word (logits float32) and the W8A8
    one raised oneDNN's 'weight scales should be dtype c10::ScalarType::Float'."""
    model = decoder()
    if mode == "weight-only":
        qmodel = qp.quantize_weights(model, bits=8, kernel="torch-int8pack")
        match = rf"cast to {dtype} after quantizing.*qp\.quantize_weights\(model\.to\({dtype}\), \.\.\.\)"
    else:
        qmodel = qp.quantize_w8a8(model, [PROMPTS[1]])
        match = rf"cast to {dtype} after quantizing.*quantize the float32 model again and keep it float32"
    with torch.no_grad(), pytest.raises(ModelStateError, match=match):
        qmodel.to(dtype)(PROMPTS[0])


def test_the_clis_group_size_error_names_no_option_the_cli_lacks(tmp_path, monkeypatch):
    """Before: it suggested skip=[...], a Python argument `qplug quantize` has no option for."""
    from typer.testing import CliRunner

    from qplug_core.cli.app import app

    (tmp_path / "llm_report_models.py").write_text(
        "import torch\n\ndef mlp():\n    return torch.nn.Sequential(torch.nn.Linear(128, 16))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    result = CliRunner().invoke(app, ["quantize", "llm_report_models:mlp", "--example-shape", "1,128", "--out",
                                      str(tmp_path / "m.safetensors"), "--mode", "weight-only", "--group-size", "48"])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "qplug: error: group_size 48 does not divide the 128 input features of layer '0'; pick a divisor of it "
        "for --group-size")
    with pytest.raises(ConfigValidationError, match=r"pick a divisor of it or leave the layer float with skip=\['0'\]"):
        qp.quantize_weights(torch.nn.Sequential(torch.nn.Linear(128, 16)), group_size=48)


def test_smoothed_lists_only_inputs_a_scale_was_folded_into(tmp_path):
    """Before: .smoothed (and so the guide's loop over it) listed inputs alpha="auto" chose not to
    smooth, with alpha None (6 entries, 3 of them folded nothing); `qplug report` counted them too."""
    import json

    from typer.testing import CliRunner

    from qplug_core.cli.app import app

    calibration = [torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    model = decoder()
    with torch.no_grad():  # untrained norms (all ones): some inputs gain nothing from smoothing
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
    qmodel = qp.quantize_w8a8(model, calibration)
    info = qmodel.qplug_w8a8
    assert info.smoothed and all(entry.alpha is not None for entry in info.smoothed), info.smoothed
    declined = {name: why for name, why in info.unsmoothed.items() if "alpha='auto'" in why}
    assert declined, info.unsmoothed  # the inputs left as they were say so, with their error
    assert all(why.startswith("not smoothed: alpha='auto' found no strength that lowers the int8 output "
                              "error of ") for why in declined.values())
    assert not declined.keys() & {name for entry in info.smoothed for name in entry.layers}
    path = qp.save(qmodel, tmp_path / "w8a8.safetensors")
    result = CliRunner().invoke(app, ["report", str(path), "--json"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["smoothed_groups"] == len(info.smoothed)


def weight_normed(wrap=torch.nn.utils.weight_norm):
    """Two linears, the first with the old hook-based ``torch.nn.utils.weight_norm`` (deepcopy refuses it)
    or another ``wrap``, and the same model with plain linears holding the weights it computes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(wrap(torch.nn.Linear(64, 64)), torch.nn.ReLU(),
                                torch.nn.Linear(64, 8)).eval()
    plain = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).eval()
    model(torch.zeros(1, 64))  # the hook computes .weight, a non-leaf tensor (as after training)
    with torch.no_grad():
        plain.load_state_dict({"0.weight": model[0].weight, "0.bias": model[0].bias,
                               "2.weight": model[2].weight, "2.bias": model[2].bias})
    return model, plain


@pytest.mark.parametrize("call", ["rtn", "awq", "w8a8"])
@pytest.mark.parametrize("wrap", [torch.nn.utils.weight_norm, torch.nn.utils.parametrizations.weight_norm],
                         ids=["hook", "parametrization"])
def test_a_weight_norm_model_quantizes_as_the_plain_one(call, wrap):
    """Before: `copy.deepcopy` of the user's model raised torch's "Only Tensors created explicitly by the
    user ..." in qp.quantize_weights and qp.quantize_w8a8 (hook), and a parametrized linear was left float
    as a subclass of nn.Linear (parametrization)."""
    model, plain = weight_normed(wrap)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(1))

    def quantize(m):
        if call == "w8a8":
            return qp.quantize_w8a8(m, alpha=None, backend="reference")
        return qp.quantize_weights(m, bits=4, group_size=32, algorithm=call, kernel="reference",
                                   calibration_data=None if call == "rtn" else [x])

    qmodel, want = quantize(model), quantize(plain)
    with torch.no_grad():
        torch.testing.assert_close(qmodel(x), want(x), rtol=0, atol=0)
        assert float(torch.nn.functional.cosine_similarity(qmodel(x).flatten(), model(x).flatten(), 0)) > 0.99
    record = getattr(qmodel, "qplug_w8a8" if call == "w8a8" else "qplug_weight_only")
    assert set(record.layers) == {"0", "2"}
    assert {"weight_g", "parametrizations.weight.original0"} & dict(model[0].named_parameters()).keys()


def test_the_cli_accuracy_of_a_training_mode_weight_norm_model_is_measured_in_eval_mode():
    """Before: `qplug quantize`/`report`'s accuracy deep-copied a training-mode float model to put the
    copy in eval mode, and the hook-based weight_norm made that raise."""
    from qplug_core.cli._accuracy import accuracy_document

    model, plain = weight_normed()
    qmodel = qp.quantize_weights(model, bits=8, kernel="reference")
    model.train()
    x = (torch.randn(6, 64, generator=torch.Generator().manual_seed(1)),)
    document = accuracy_document(model, qmodel, [x], backend="fbgemm", evaluated_on="x")
    want = qp.compare(plain, qmodel, [x])
    assert document["compared_against"] == "fused float model (qp.fuse_fx)"
    assert document["output_cosine"] == pytest.approx(want.output_cosine, abs=1e-6)
    assert document["output_sqnr_db"] == pytest.approx(want.output_sqnr_db, abs=0.01)
    assert want.output_sqnr_db > 30
    assert model.training and model[0].training  # the user's model is left in its own mode


def test_awq_keeps_the_qkv_and_gate_up_fusion_and_rtns_accuracy():
    """Before: AWQ searched an input scale per linear, so no q/k/v or gate/up group could run as one
    kernel call (0 groups instead of 4), and `.fusion` did not say why."""
    from tests.unit.weight_only.test_w8a8 import batches

    model = decoder()
    awq = qp.quantize_weights(model, bits=4, group_size=32, algorithm="awq", calibration_data=batches(2),
                              kernel="reference")
    rtn = qp.quantize_weights(model, bits=4, group_size=32, kernel="reference")
    groups = [tuple(f"model.layers.{i}.{names}" for names in group) for i in range(2)
              for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                            ("mlp.gate_proj", "mlp.up_proj"))]
    assert awq.qplug_weight_only.fused == rtn.qplug_weight_only.fused == groups
    assert awq.qplug_weight_only.fusion == "looked for on the model's dummy_inputs"
    attention = awq.model.layers[0].self_attn
    assert torch.equal(attention.q_proj.input_scale, attention.v_proj.input_scale)

    def cosine(qmodel):
        with torch.no_grad():
            return float(torch.nn.functional.cosine_similarity(
                qmodel(PROMPTS[1]).logits.flatten(), model(PROMPTS[1]).logits.flatten(), 0))

    assert cosine(awq) >= cosine(rtn) > 0.98  # 0.9911 and 0.9867 (per-linear AWQ scales: 0.9896)


def test_the_readme_flow_reports_a_decoder_llm_quantize_sent_to_w8a8():
    """Before: `print(qp.quantization_report(qmodel))` after `qp.quantize(llm, ...)` (the README's "Use it")
    raised ConfigValidationError: qp.quantize had kept generate() through qp.quantize_w8a8."""
    from tests.unit.weight_only.test_w8a8 import batches

    model = decoder()
    qmodel = qp.quantize(model, (PROMPTS[0],), batches(2), backend="fbgemm")
    info = qmodel.qplug_w8a8
    report = qp.quantization_report(qmodel)
    assert (report.mode, report.capture, report.backend) == ("W8A8", "module swap", "per-layer kernels")
    assert report.quantized == info.layers and len(info.layers) == 14
    assert set(report.kernels) == set(info.layers)
    assert [(s.node, s.op, s.reason) for s in report.skipped] == [
        ("lm_head", "Linear", "the output head stays float (quantize_head=True quantizes it)")]
    assert report.record["smoothed_into"] == {e.into: f"(alpha {e.alpha})" for e in info.smoothed}
    assert report.record["smoothed_groups"] == len(info.smoothed) > 0
    text = str(report).splitlines()
    assert text[:3] == ["qplug quantization report: W8A8, quantized by module swap (per-layer kernels)",
                        "quantized: 14 layer(s), 1 layer(s) left in float (93% quantized)",
                        "  activations: per_token"]
    assert "   1  the output head stays float (quantize_head=True quantizes it)" in text
    assert report.to_dict()["quantized"] == info.layers


def test_a_weight_only_report_names_the_scheme_the_kernels_and_what_stayed_float():
    model = tiny_gpt2()  # its lm_head is tied to the input embedding: left float
    qmodel = qp.quantize_weights(model, bits=4, group_size=32, symmetric=False, kernel="reference",
                                 skip=[r".*\.1\.mlp\.c_proj"])
    info = qmodel.qplug_weight_only
    report = qp.quantization_report(qmodel)
    assert (report.mode, report.quantized, report.kernels) == ("weight-only", info.layers, info.kernels)
    assert report.record == {"scheme": "int4 asymmetric, groups of 32", "algorithm": "rtn",
                             "fusion": info.fusion}
    assert {(s.node, s.op, s.reason) for s in report.skipped} == {
        ("transformer.h.1.mlp.c_proj", "Conv1D", "skip= matches its name"),
        ("lm_head", "Linear", "its weight is tied to the input embedding")}
    text = str(report)
    assert "  scheme: int4 asymmetric, groups of 32\n" in text and "  algorithm: rtn\n" in text
    assert f"quantized: {len(info.layers)} layer(s), 2 layer(s) left in float" in text
