"""The reference architectures: torchvision-exact layouts, traceability, masking, determinism."""

from __future__ import annotations

import math
import operator
import sys
import time

import pytest
import torch
from torch import nn

from qplug_core.errors import ConfigError, ConfigValidationError, QplugError
from qplug_core.zoo import calibrate_batchnorm, example_inputs, get_model, list_models
from qplug_core.zoo.digits import accuracy, load_digits_tensors, train_digits_cnn
from qplug_core.zoo.lstm import RecurrentClassifier
from qplug_core.zoo.transformer import make_realistic_bert

pytestmark = pytest.mark.usefixtures("one_thread")


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def call_module_targets(gm: torch.fx.GraphModule) -> list[str]:
    return [n.target for n in gm.graph.nodes if n.op == "call_module"]


def assert_traces_exactly(model: nn.Module,
                          inputs: tuple[torch.Tensor, ...]) -> torch.fx.GraphModule:
    gm = torch.fx.symbolic_trace(model)
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs), model(*inputs), rtol=0, atol=0)
    return gm


# -- registry --------------------------------------------------------------------------------------


def test_registry_lists_the_reference_models():
    assert {"resnet18", "mobilenet_v2", "bert_encoder", "lstm_classifier", "digits_cnn"} <= set(
        list_models())
    assert list_models() == sorted(list_models())


def test_unknown_model_name_suggests_the_close_one():
    with pytest.raises(ConfigError, match=r"did you mean 'mobilenet_v2'\?") as info:
        get_model("mobilenet-v2")
    assert info.value.field == "name"
    with pytest.raises(ConfigError, match="available: bert_encoder"):
        example_inputs("nope")


def test_unknown_builder_option_is_a_config_error():
    with pytest.raises(ConfigError, match="did you mean 'num_classes'") as info:
        get_model("resnet18", num_class=10)
    assert info.value.field == "num_class"


def test_seeded_build_is_reproducible_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = get_model("digits_cnn", seed=0)
    b = get_model("digits_cnn", seed=0)
    assert torch.equal(torch.get_rng_state(), before)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(get_model("digits_cnn", seed=1).conv1.weight, a.conv1.weight)
    assert not a.training and get_model("digits_cnn", train=True).training


def test_builder_kwargs_reach_the_model_and_inputs():
    model = get_model("lstm_classifier", seed=0, input_size=5, num_classes=3)
    (x,) = example_inputs("lstm_classifier", batch=4, input_size=5)
    assert x.shape == (4, 8, 5)
    assert model(x).shape == (4, 3)
    assert torch.equal(example_inputs("lstm_classifier", batch=4, input_size=5)[0], x)


# -- ResNet ----------------------------------------------------------------------------------------


def test_resnet18_matches_torchvision_layout_and_size():
    model = get_model("resnet18", seed=0)
    assert num_params(model) == 11_689_512
    modules = dict(model.named_modules())
    expected = {
        "conv1": nn.Conv2d, "bn1": nn.BatchNorm2d, "relu": nn.ReLU, "maxpool": nn.MaxPool2d,
        "layer1.0.conv1": nn.Conv2d, "layer1.0.bn1": nn.BatchNorm2d, "layer1.0.relu": nn.ReLU,
        "layer1.0.conv2": nn.Conv2d, "layer1.0.bn2": nn.BatchNorm2d,
        "layer2.0.downsample.0": nn.Conv2d, "layer2.0.downsample.1": nn.BatchNorm2d,
        "layer4.1.bn2": nn.BatchNorm2d, "avgpool": nn.AdaptiveAvgPool2d, "fc": nn.Linear,
    }
    for name, cls in expected.items():
        assert type(modules[name]) is cls, name
    assert model.layer1[0].downsample is None and "layer5" not in modules
    assert modules["conv1"].kernel_size == (7, 7) and modules["conv1"].stride == (2, 2)
    assert modules["layer2.0.downsample.0"].stride == (2, 2)
    assert modules["relu"].inplace


def test_resnet18_uses_torchvision_init():
    model = get_model("resnet18", seed=0)
    conv = model.layer4[1].conv2  # fan_out = 512 * 3 * 3
    assert conv.weight.std().item() == pytest.approx(math.sqrt(2 / (512 * 9)), rel=0.02)
    assert all(torch.equal(bn.weight, torch.ones_like(bn.weight)) and not bn.bias.any()
               for bn in model.modules() if isinstance(bn, nn.BatchNorm2d))


def test_resnet18_traces_with_shared_relu_and_plain_add():
    model = get_model("resnet18", seed=0, num_classes=10)
    (x,) = example_inputs("resnet18", batch=2)
    gm = assert_traces_exactly(model, (x,))
    assert model(x).shape == (2, 10)
    targets = call_module_targets(gm)
    assert targets.count("layer1.0.relu") == 2  # torchvision reuses one ReLU per block
    adds = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is operator.add]
    assert len(adds) == 8  # `out += identity` traces as operator.add, one per BasicBlock


def test_resnet50_matches_torchvision_size():
    assert num_params(get_model("resnet50")) == 25_557_032


# -- MobileNetV2 -----------------------------------------------------------------------------------


def test_mobilenet_v2_matches_torchvision_layout_and_size():
    model = get_model("mobilenet_v2", seed=0)
    assert num_params(model) == 3_504_872
    modules = dict(model.named_modules())
    expected = {
        "features.0.0": nn.Conv2d, "features.0.1": nn.BatchNorm2d, "features.0.2": nn.ReLU6,
        "features.1.conv.0.0": nn.Conv2d, "features.1.conv.0.2": nn.ReLU6,
        "features.1.conv.1": nn.Conv2d, "features.1.conv.2": nn.BatchNorm2d,
        "features.2.conv.0.0": nn.Conv2d, "features.2.conv.1.0": nn.Conv2d,
        "features.2.conv.2": nn.Conv2d, "features.18.0": nn.Conv2d,
        "classifier.0": nn.Dropout, "classifier.1": nn.Linear,
    }
    for name, cls in expected.items():
        assert type(modules[name]) is cls, name
    assert len(model.features) == 19
    assert modules["features.1.conv.0.0"].groups == 32  # depthwise
    assert modules["features.18.0"].out_channels == 1280
    assert modules["classifier.0"].p == 0.2
    assert sum(block.use_res_connect for block in model.features[1:18]) == 10


def test_mobilenet_v2_traces_and_runs():
    model = get_model("mobilenet_v2", seed=0)
    (x,) = example_inputs("mobilenet_v2", batch=2)
    gm = assert_traces_exactly(model, (x,))
    assert model(x).shape == (2, 1000)
    adds = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is operator.add]
    assert len(adds) == 10


def test_mobilenet_v2_width_multiplier():
    model = get_model("mobilenet_v2", width_mult=0.5, num_classes=7)
    assert model.features[0][0].out_channels == 16 and model.last_channel == 1280
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 7)


def test_calibrate_batchnorm_gives_trained_like_activation_scale():
    model = get_model("mobilenet_v2", seed=0, train=True)
    (x,) = example_inputs("mobilenet_v2", batch=1, seed=9)
    weight = model.features[1].conv[1].weight.clone()
    with torch.no_grad():
        assert model.eval()(x).std() < 1e-6  # random init: eval-mode activations collapse
    model.train()
    calibrate_batchnorm(model, [example_inputs("mobilenet_v2", batch=4, seed=s) for s in range(2)])
    assert all(m.training for m in model.modules())
    bn = model.features[0][1]
    assert bn.momentum == 0.1 and int(bn.num_batches_tracked) == 2
    assert torch.equal(model.features[1].conv[1].weight, weight)
    with torch.no_grad():
        assert model.eval()(x).std() > 1e-2


# -- BERT-style encoder ----------------------------------------------------------------------------


def test_bert_encoder_layout_and_trace():
    model = get_model("bert_encoder", seed=0)
    modules = dict(model.named_modules())
    for name in ("encoder.layer.0.attention.self.query", "encoder.layer.0.attention.self.key",
                 "encoder.layer.0.attention.self.value", "encoder.layer.0.attention.output.dense",
                 "encoder.layer.1.intermediate.dense", "encoder.layer.1.output.dense"):
        assert type(modules[name]) is nn.Linear, name
    assert isinstance(modules["encoder.layer.0.intermediate.intermediate_act_fn"], nn.GELU)
    ids, mask = example_inputs("bert_encoder", batch=4)
    gm = assert_traces_exactly(model, (ids, mask))
    assert model(ids, mask).shape == (4, 128)
    assert torch.matmul in [n.target for n in gm.graph.nodes]
    # the traced graph is not specialised to one sequence length
    short = (ids[:, :5], mask[:, :5])
    torch.testing.assert_close(gm(*short), model(*short), rtol=0, atol=0)


def test_bert_mask_hides_padding_tokens():
    model = get_model("bert_encoder", seed=0)
    ids, mask = example_inputs("bert_encoder", batch=2)
    assert (mask[1] == 0).any()
    padded = mask[1] == 0
    other_ids = ids.clone()
    other_ids[1, padded] = (ids[1, padded] + 17) % 1000
    with torch.no_grad():
        ref = model(ids, mask)
        torch.testing.assert_close(model(other_ids, mask), ref, rtol=0, atol=1e-6)
        other_ids[1, 0] = (ids[1, 0] + 1) % 1000  # a real token does matter
        assert not torch.allclose(model(other_ids, mask)[1], ref[1], atol=1e-4)


def test_bert_is_deterministic_in_eval():
    ids, mask = example_inputs("bert_encoder", batch=2)
    with torch.no_grad():
        a = get_model("bert_encoder", seed=3)(ids, mask)
        b = get_model("bert_encoder", seed=3)(ids, mask)
    assert torch.equal(a, b)


def test_bert_rejects_heads_that_do_not_divide_hidden():
    with pytest.raises(ConfigValidationError, match="not divisible") as info:
        get_model("bert_encoder", hidden=130, heads=4)
    assert info.value.field == "heads"


def test_realistic_bert_has_outlier_channels():
    model = make_realistic_bert(seed=0)
    ids, mask = example_inputs("bert_encoder", batch=4)
    seen: list[torch.Tensor] = []
    handle = model.encoder.layer[1].output.LayerNorm.register_forward_hook(
        lambda m, args, out: seen.append(out))
    with torch.no_grad():
        model(ids, mask)
    handle.remove()
    peak = seen[0].abs().amax(dim=(0, 1))
    outliers, rest = peak[[7, 77]], torch.cat([peak[:7], peak[8:77], peak[78:]])
    assert outliers.min() > 5 * rest.max()


# -- recurrent -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, rnn_type", [("lstm_classifier", nn.LSTM),
                                            ("gru_classifier", nn.GRU)])
def test_recurrent_classifiers(name, rnn_type):
    model = get_model(name, seed=0)
    assert type(model.rnn) is rnn_type and model.rnn.batch_first
    inputs = example_inputs(name, batch=3)
    assert_traces_exactly(model, inputs)
    assert model(*inputs).shape == (3, 10)
    tokens = get_model(name, vocab_size=50, num_classes=4)
    (ids,) = example_inputs(name, batch=2, vocab_size=50)
    assert ids.dtype == torch.int64 and tokens(ids).shape == (2, 4)


def test_unknown_recurrent_cell():
    with pytest.raises(ConfigValidationError, match="did you mean 'gru'"):
        RecurrentClassifier(4, 8, 1, 2, cell="gruu")


# -- digits ----------------------------------------------------------------------------------------


def test_digits_tensors_are_fixed_and_standardised():
    x_train, y_train, x_test, y_test = load_digits_tensors()
    assert x_train.shape == (1347, 1, 8, 8) and x_test.shape == (450, 1, 8, 8)
    assert y_train.dtype == torch.int64 and set(y_test.tolist()) == set(range(10))
    assert abs(x_train.mean().item()) < 1e-5 and x_train.std().item() == pytest.approx(1, abs=1e-4)
    assert torch.equal(load_digits_tensors()[2], x_test)


def test_digits_without_sklearn_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(QplugError, match="pip install scikit-learn"):
        load_digits_tensors()


def test_digits_cnn_trains_fast_accurately_and_deterministically():
    torch.set_num_threads(2)
    start = time.perf_counter()
    model, acc = train_digits_cnn(seed=0)
    elapsed = time.perf_counter() - start
    print(f"digits_cnn: test accuracy {acc:.4f} after {elapsed:.2f} s")
    assert acc >= 0.95
    assert not model.training
    assert torch.get_num_threads() == 2 and not torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    again, acc_again = train_digits_cnn(seed=0)
    assert acc_again == acc
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
    assert_traces_exactly(model, example_inputs("digits_cnn", batch=4))


def test_accuracy_restores_training_mode():
    model = get_model("digits_cnn", seed=0, train=True)
    x, y = torch.randn(10, 1, 8, 8), torch.arange(10)
    assert 0.0 <= accuracy(model, x, y) <= 1.0
    assert all(m.training for m in model.modules())
