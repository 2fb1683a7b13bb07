"""Linears reading one input run as one kernel call (``qplug_core.weight_only.fusion``): found on the
model's own dummy input or the first calibration batch, outputs equal to one call per layer with
the same kernel, correct when the input changes in place or differs, no weight held twice, and
kept by ``qp.save`` / ``qp.load``; a tampered group in the file is refused."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

import qplug_core as qp
from qplug_core.errors import SerializationError
from qplug_core.serialization.files import METADATA_KEY
from qplug_core.weight_only import api, fusion
from tests.unit.weight_only.test_w8a8 import GREEDY, PROMPTS, decoder

#: (bits, group size, the core's kernels taking that scheme); the plugins' kernels: their own tests
SCHEMES = [(4, 32, "reference"), (8, 32, "reference"), (4, 32, "torch-int4pack"), (8, None, "torch-int8pack")]
LAYERS = [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")]


def separate(monkeypatch, model: nn.Module, **options) -> nn.Module:
    """``model`` quantized with one kernel call per layer."""
    with monkeypatch.context() as patch:
        patch.setattr(api, "sibling_groups", lambda *args: ([], "off"))
        return qp.quantize_weights(model, **options)


def expected_groups(layers: int) -> list[tuple[str, ...]]:
    return [tuple(f"model.layers.{i}.{part}.{name}" for name in names)
            for i in range(layers) for part, names in zip(("self_attn", "mlp"), LAYERS, strict=True)]


@pytest.mark.parametrize(("bits", "group_size", "kernel"), SCHEMES)
def test_a_decoder_runs_qkv_and_gate_up_as_one_call_with_unchanged_outputs(monkeypatch, bits, group_size, kernel):
    model = decoder()
    options = dict(bits=bits, group_size=group_size, kernel=kernel)
    fused = qp.quantize_weights(model, **options)
    one_each = separate(monkeypatch, model, **options)
    assert fused.qplug_weight_only.fused == expected_groups(2)
    assert one_each.qplug_weight_only.fused == []
    with torch.no_grad():
        assert torch.equal(fused(PROMPTS[0]).logits, one_each(PROMPTS[0]).logits)
        assert torch.equal(fused.generate(PROMPTS[0], **GREEDY), one_each.generate(PROMPTS[0], **GREEDY))


@pytest.mark.parametrize("family", ["qwen2", "gemma"])
def test_other_families_too_biases_included(monkeypatch, family):
    """Qwen2's q/k/v have biases (stacked with the rows); Gemma's MLP has its own activation."""
    model = decoder(family)
    fused = qp.quantize_weights(model, bits=8, group_size=32, kernel="reference")
    one_each = separate(monkeypatch, model, bits=8, group_size=32, kernel="reference")
    assert fused.qplug_weight_only.fused == expected_groups(2)
    with torch.no_grad():
        assert torch.equal(fused(PROMPTS[3]).logits, one_each(PROMPTS[3]).logits)


def test_members_keep_their_buffers_as_views_of_one_weight():
    fused = qp.quantize_weights(decoder(), bits=4, group_size=32, kernel="reference")
    attention = fused.model.layers[0].self_attn
    members = [attention.q_proj, attention.k_proj, attention.v_proj]
    storages = {m.qweight.untyped_storage().data_ptr() for m in members}
    assert len(storages) == 1
    group = members[0].fused[0]
    assert [m.fused for m in members] == [(group, 0), (group, 1), (group, 2)]
    assert group.sizes == [m.out_features for m in members]


class Siblings(nn.Module):
    """Two linears meant to read one tensor; ``change`` alters it in place between them, or hands
    the second another tensor."""

    def __init__(self, change: str = "none"):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(64, 32), nn.Linear(64, 48, bias=False)
        self.change = change

    def forward(self, x):
        first = self.a(x)
        if self.change == "in place":
            x.mul_(2)
        return first, self.b(x * 3 if self.change == "other" else x)


@pytest.mark.parametrize("change", ["none", "in place", "other"])
@pytest.mark.parametrize("inference", [False, True])
def test_each_member_gets_what_its_own_call_would_give(monkeypatch, change, inference):
    x = torch.randn(5, 64)
    fused = qp.quantize_weights(Siblings(), bits=8, group_size=32, kernel="reference", calibration_data=[x.clone()])
    one_each = separate(monkeypatch, Siblings(), bits=8, group_size=32, kernel="reference")
    assert fused.qplug_weight_only.fused == [("a", "b")]
    fused.change = one_each.change = change
    context = torch.inference_mode() if inference else torch.no_grad()
    for _ in range(2):
        with context:
            got, want = fused(x.clone()), one_each(x.clone())
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_awq_gives_the_linears_of_one_input_one_scale_so_they_stay_joined():
    x = torch.randn(64, 64) * torch.linspace(0.1, 10, 64)
    awq = qp.quantize_weights(Siblings(), bits=4, group_size=32, kernel="reference", algorithm="awq",
                              calibration_data=[x])
    assert awq.qplug_weight_only.fused == [("a", "b")]
    assert torch.equal(awq.a.input_scale, awq.b.input_scale)
    assert not torch.equal(awq.a.input_scale, torch.ones(64))  # a scale was searched


def test_layers_with_different_input_scales_stay_apart_and_say_why(monkeypatch):
    x = torch.randn(64, 64) * torch.linspace(0.1, 10, 64)
    qmodel = separate(monkeypatch, Siblings(), bits=4, group_size=32, kernel="reference", algorithm="awq",
                      calibration_data=[x])
    qmodel.b.input_scale = qmodel.b.input_scale * 2  # edited: one call cannot apply both
    dtypes = dict.fromkeys("ab", torch.float32)
    kernels = api.available_kernels(None)
    joined, refused = fusion.fuse(qmodel, [("a", "b")], dtypes,
                                  lambda names, weight, dtype: api.choose(weight, kernels, dtype, forced="reference"))
    assert joined == [] and qmodel.a.fused is None
    assert refused == {("a", "b"): "their input scales (AWQ's 1 / s) differ, which one call cannot apply"}


def test_a_model_without_an_example_input_runs_one_call_per_layer_and_says_why():
    qmodel = qp.quantize_weights(Siblings(), bits=8, kernel="reference")
    assert qmodel.qplug_weight_only.fused == [] and qmodel.a.fused is None
    assert qmodel.qplug_weight_only.fusion == ("not looked for: the model has no dummy_inputs and calibration "
                                               "is not a list of batches; pass calibration_data=[batch] to let "
                                               "qplug find the layers reading one input (q/k/v)")
    wrong = qp.quantize_weights(Siblings(), bits=8, kernel="reference", calibration_data=[torch.randn(5, 7)])
    assert wrong.qplug_weight_only.fused == []
    assert wrong.qplug_weight_only.fusion.startswith("not found: the run on the first calibration batch raised "
                                                     "RuntimeError: mat1 and mat2 shapes cannot be multiplied")
    assert qp.quantize_weights(decoder(), bits=8, kernel="reference").qplug_weight_only.fusion == \
        "looked for on the model's dummy_inputs"


def test_a_copy_computes_with_groups_of_its_own():
    fused = qp.quantize_weights(decoder(), bits=8, group_size=32, kernel="reference")
    clone = copy.deepcopy(fused)
    assert clone.model.layers[0].self_attn.q_proj.fused[0] is not fused.model.layers[0].self_attn.q_proj.fused[0]
    with torch.no_grad():
        assert torch.equal(clone(PROMPTS[1]).logits, fused(PROMPTS[1]).logits)


def test_the_groups_are_saved_and_joined_again_at_load(tmp_path):
    fused = qp.quantize_weights(decoder(), bits=4, group_size=32)
    path = qp.save(fused, tmp_path / "m.qplug")
    loaded = qp.load(path, model=decoder(seed=1))
    assert loaded.qplug_weight_only.fused == expected_groups(2) and loaded.qplug_weight_only.fusion == "as saved"
    assert loaded.model.layers[1].mlp.up_proj.fused is not None
    with torch.no_grad():
        assert torch.equal(loaded(PROMPTS[2]).logits, fused(PROMPTS[2]).logits)


def test_a_group_naming_what_is_not_a_linear_layer_of_the_file_is_refused(tmp_path):
    path = qp.save(qp.quantize_weights(decoder(), bits=8, kernel="reference"), tmp_path / "m.qplug")
    with safe_open(str(path), "pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    document = json.loads(metadata[METADATA_KEY])
    document["fused"] = [["model.layers.0.self_attn.q_proj", "os.system"]]
    # written without the digest, as an older file: the document's own checks are what is tested
    save_file(tensors, str(path), metadata={METADATA_KEY: json.dumps(document)})
    with pytest.raises(SerializationError, match="fused group .* names layers that are not linear layers"):
        qp.load(path, model=decoder())


def test_the_run_that_finds_the_groups_updates_no_statistics_of_a_training_model():
    model = nn.Sequential(nn.BatchNorm1d(64), Siblings()).train()
    qmodel = qp.quantize_weights(model, bits=8, kernel="reference", calibration_data=[torch.randn(5, 64) + 3])
    assert qmodel.qplug_weight_only.fused == [("1.a", "1.b")]
    assert not any(m.training for m in qmodel.modules()) and all(m.training for m in model.modules())
    assert torch.equal(qmodel[0].running_mean, model[0].running_mean)  # no statistics updated


def test_a_forced_kernel_that_refuses_the_stacked_shape_leaves_the_group_apart(monkeypatch):
    from qplug_core.kernels.weight_only import TorchInt4Kernel

    refuse = TorchInt4Kernel.supports
    monkeypatch.setattr(TorchInt4Kernel, "supports", lambda self, scheme, shape, dtype: (
        "at most 64 output features" if shape[0] > 64 else refuse(self, scheme, shape, dtype)))
    qmodel = qp.quantize_weights(Siblings(), bits=4, group_size=32, kernel="torch-int4pack",
                                 calibration_data=[torch.randn(5, 64)])
    assert qmodel.qplug_weight_only.fused == [] and qmodel.a.fused is None
    assert qmodel.qplug_weight_only.fusion == ("looked for on the first calibration batch; not joined: a, b "
                                               "(kernel 'torch-int4pack' does not take their stacked weight)")
