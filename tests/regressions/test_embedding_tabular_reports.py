"""Defects a recommendation/tabular-model user found (2026-12-06): each test is that user's own
call, with the numbers or the error they rely on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.algorithms.architecture import looks_like_transformer
from qplug_core.errors import InputMismatchError
from qplug_core.weight_only import WeightOnlyEmbeddingBag

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


class PaddedBag(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(100, 8, mode=mode, padding_idx=0)
        self.fc = nn.Linear(8, 1)

    def forward(self, idx: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bag(idx, off))


@pytest.mark.parametrize("backend", ["fbgemm", "qnnpack"])
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_a_bag_padded_only_at_serving_time_leaves_the_padding_out(backend, mode):
    """The 8-bit bag kernel ignored padding_idx: a mean bag padded at serving time was the float
    bag x real count / padded count (max error 0.15-0.18), and the contract check could not see
    it because the example and calibration bags held no padding."""
    torch.manual_seed(0)
    model = PaddedBag(mode).eval()
    with torch.no_grad():
        model.bag.weight[0].normal_()  # a loaded checkpoint's padding row need not be zero
    example = (torch.tensor([5, 6, 7, 8]), torch.tensor([0, 2]))
    calibration = [(torch.randint(1, 100, (40,)), torch.arange(0, 40, 4)) for _ in range(4)]
    int8 = qp.quantize(model, example, calibration, backend=backend)
    assert qp.quantization_report(int8).kernels["bag"] == "quantized::embedding_bag_byte"
    idx, off = torch.tensor([5, 6, 0, 0, 7, 8, 9, 0, 0, 0]), torch.tensor([0, 4, 8])  # last bag: all padding
    with torch.no_grad():
        error = (int8.bag(idx, off) - model.bag(idx, off)).abs().max()
    assert error < 0.02  # row quantization: 0.003-0.008 measured; 0.15-0.18 (mean) before


class WideAndDeep(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.user = nn.Embedding(50, 16, padding_idx=0)
        self.items = nn.EmbeddingBag(200, 16, mode=mode, padding_idx=0)
        self.mlp = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, uid: torch.Tensor, items: torch.Tensor, off: torch.Tensor,
                weights: torch.Tensor | None = None) -> torch.Tensor:
        return self.mlp(torch.cat([self.user(uid), self.items(items, off, per_sample_weights=weights)], 1))


@pytest.mark.parametrize("bits, group_size, tolerance", [(8, None, 0.02), (4, 8, 0.3)])
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_quantize_weights_takes_embedding_bags_and_saves_them(mode, bits, group_size, tolerance, tmp_path):
    """quantize_weights(embeddings=True) left every nn.EmbeddingBag float (the largest tables of a
    recommender: 640 KB kept of 785 KB) and listed none of them in ``skipped``."""
    torch.manual_seed(0)
    model = WideAndDeep(mode).eval()
    int8 = qp.quantize_weights(model, bits=bits, group_size=group_size, embeddings=True)
    info = int8.qplug_weight_only
    assert info.layers["items"] == "embedding_bag" and info.skipped == {}
    assert isinstance(int8.items, WeightOnlyEmbeddingBag)
    uid = torch.tensor([1, 2, 0])
    items, off = torch.tensor([3, 0, 4, 0, 0, 9, 9, 199]), torch.tensor([0, 2, 5])
    weights = torch.rand(8) if mode == "sum" else None
    with torch.no_grad():
        want = model.items(items, off, per_sample_weights=weights)
        got = int8.items(items, off, per_sample_weights=weights)
        assert (got - want).abs().max() < tolerance  # 8-bit: ~0.01, 4-bit: ~0.15 measured
        assert torch.equal(int8.items(items.view(2, 4)), int8.items(items, torch.tensor([0, 4])))
        path = qp.save(int8, tmp_path / "wide.safetensors")
        loaded = qp.load(path, model=WideAndDeep(mode).eval())
        assert loaded.qplug_weight_only.layers["items"] == "embedding_bag"
        assert torch.equal(loaded(uid, items, off, weights), int8(uid, items, off, weights))


def test_quantize_weights_says_why_a_renormalised_bag_stays_float():
    model = nn.Sequential(nn.EmbeddingBag(20, 8, max_norm=1.0), nn.Linear(8, 2))
    int8 = qp.quantize_weights(model, embeddings=True)
    assert "max_norm=1.0 renormalises the rows" in int8.qplug_weight_only.skipped["0"]
    assert type(int8[0]) is nn.EmbeddingBag


def tabular_mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(30, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Dropout(0.2),
                         nn.Linear(128, 64), nn.LayerNorm(64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))


def test_a_tabular_mlp_with_one_layernorm_is_quantized_as_an_mlp():
    """Any LayerNorm beside a Linear made a "transformer": SmoothQuant and the transformer target
    moved every linear of a binary classifier to per-token dynamic int8, 5x slower than float."""
    torch.manual_seed(0)
    model = tabular_mlp().eval()
    assert not looks_like_transformer(model)
    x = torch.randn(512, 30)
    int8 = qp.quantize(model, (x[:1],), [x[i:i + 64] for i in range(0, 512, 64)], backend="fbgemm")
    assert int8.meta["qplug_recipe"].name == "auto: bias_correction"
    assert set(qp.quantization_report(int8).kernels.values()) == {"quantized::linear"}
    assert not any(type(m).__name__ == "PerTokenDynamicLinear" for m in int8.modules())


class OneBlockAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(16, 2, batch_first=True)
        self.norm, self.ffn = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn(self.norm(x + self.attention(x, x, x)[0]))


def test_a_transformer_is_still_one():
    assert looks_like_transformer(OneBlockAttention())
    assert looks_like_transformer(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.LayerNorm(8)))


def test_a_target_on_one_logit_per_sample_scores_the_logits_not_their_signs():
    """The cosine of one logit is +1, -1 or 0, so one logit near 0 changing sign failed
    min_cosine=0.995 ("min_cosine -1") and took every layer out of static int8, at 32 dB SQNR."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(30, 128), nn.ReLU(), nn.Linear(128, 64), nn.LayerNorm(64), nn.ReLU(),
                          nn.Linear(64, 1)).eval()
    x = torch.randn(1024, 30)
    int8 = qp.quantize(model, (x[:1],), [x[i:i + 64] for i in range(0, 1024, 64)], backend="fbgemm",
                       target=qp.Target(cosine=0.998, min_cosine=0.995))
    result = int8.meta["qplug_target"]
    assert result.met and result.float_layers == []
    assert result.final.cosine_min == result.final.cosine_mean > 0.998  # one cosine: all the logits


def test_the_report_names_the_rung_a_target_moved_a_layer_to():
    """Layers a target search took out of static int8 were reported as "qconfig is None for this
    op (not requested)": the user had requested nothing, and they ran int8 per token."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    x = torch.randn(256, 16)
    int8 = qp.quantize(model, (x[:1],), [x[i:i + 64] for i in range(0, 256, 64)], backend="fbgemm",
                       target=qp.Target(sqnr=200))
    taken = {name: d.fallback for d in int8.meta["qplug_target"].decisions for name in d.layers}
    assert taken
    report = qp.quantization_report(int8)
    reasons = {s.node: s.reason for s in report.skipped}
    for name, rung in taken.items():
        if rung == "per_token":  # int8 on its own kernel, counted with the int8 layers
            assert report.kernels[name] == "per-token dynamic int8 (accuracy target)"
        elif rung == "float":  # a dynamic layer is an int8 region of its own
            assert reasons[name] == "the accuracy target took it out of static int8: it runs float"
    assert not any("not requested" in reason for reason in reasons.values())


class CategoricalColumns(nn.Module):
    """A tabular model's usual lookups: one embedding per column of the categorical matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.e0, self.e1 = nn.Embedding(10, 4), nn.Embedding(7, 4)
        self.fc = nn.Linear(3 + 8, 1)

    def forward(self, x_num: torch.Tensor, x_cat: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([x_num, self.e0(x_cat[:, 0]), self.e1(x_cat[:, 1])], 1))


@pytest.mark.parametrize("backend", ["fbgemm", "qnnpack"])
def test_embeddings_of_a_categorical_matrixs_columns_run_int8(backend, tmp_path):
    """``self.e0(x_cat[:, 0])`` hands the 8-bit lookup strided indices, which torch's op refuses:
    the int8 model raised "Expect weight, indices, and offsets to be contiguous" on any batch of more
    than one row (a one-row smoke test passed), also after qp.load."""
    torch.manual_seed(0)
    model = CategoricalColumns().eval()
    batches = [(torch.randn(64, 3), torch.stack([torch.randint(0, 10, (64,)), torch.randint(0, 7, (64,))], 1))
               for _ in range(4)]
    int8 = qp.quantize(model, batches[0], batches, backend=backend)
    report = qp.quantization_report(int8)
    assert report.kernels["e0"] == report.kernels["e1"] == "quantized::embedding_bag_byte"
    qp.save(int8, tmp_path / "tab.qplug")
    loaded = qp.load(tmp_path / "tab.qplug", backend=backend)
    for x_num, x_cat in batches[1:3]:
        out = int8(x_num, x_cat)
        assert qp.sqnr(model(x_num, x_cat), out) > 30
        assert torch.equal(loaded(x_num, x_cat), out)


class LinearBnReLU(nn.Module):
    """The standard tabular MLP block, then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn1, self.relu, self.fc2 = nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu(self.bn1(self.fc1(x))))


@pytest.mark.parametrize("backend", ["fbgemm", "qnnpack"])
def test_a_linear_bn1d_relu_block_runs_one_int8_linear(backend, recwarn):
    """Linear -> BatchNorm1d -> ReLU left fc1 in float reference form ("no kernel for ReLU <- Linear"),
    with no warning; torch.ao lowers it to int8. It now fuses to LinearReLU with the BN folded."""
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    torch.manual_seed(0)
    x = torch.randn(256, 16)
    model = LinearBnReLU()
    model.train()(x)  # running statistics that are not the identity
    model.eval()
    int8 = qp.quantize(model, (x[:1],), [x], backend=backend)
    report = qp.quantization_report(int8)
    assert report.kernels == {"fc1": "quantized::linear", "fc2": "quantized::linear"} and not report.skipped
    assert [f.fused_type for f in report.fusions] == ["LinearReLU"]
    assert not [w for w in recwarn if "qplug" in str(w.message)]
    observed = prepare_fx(model, get_default_qconfig_mapping(backend), (x[:1],))
    observed(x)
    torch_ao = convert_fx(observed)
    with torch.no_grad():
        out = int8(x)
        assert qp.sqnr(model(x), out) > 35  # 37.9 (fbgemm), 38.2 (qnnpack) measured; torch.ao 32.4
        assert qp.sqnr(torch_ao(x), out) > 28  # 31.2, 31.1 measured


def test_a_weighted_layer_without_a_kernel_says_it_runs_in_reference_form():
    """A matched int8 region the backend has no kernel for stayed in reference form (float compute)
    with only a report entry; a weighted layer left so now warns once, naming it."""
    dtypes = qp.DTypeConfig(input_dtype=torch.quint8, output_dtype=torch.quint8, weight_dtype=torch.qint8,
                            bias_dtype=torch.float)
    config = (qp.BackendConfig("pairs")  # (Linear, ReLU) as a region with no fusion: no kernel keys it
              .set_backend_pattern_config(qp.BackendPatternConfig((nn.Linear, nn.ReLU)).add_dtype_config(dtypes))
              .set_backend_pattern_config(qp.BackendPatternConfig(nn.Linear).add_dtype_config(dtypes)
                                          .set_root_module(nn.Linear)))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).eval()
    x = torch.randn(64, 8)
    with pytest.warns(UserWarning, match=r"backend 'fbgemm' has no int8 kernel for these layers, which run in "
                                         r"reference form \(int8-rounded weights, float compute\): "
                                         r"'0' \(ReLU <- Linear\)\. Use a backend"):
        int8 = qp.quantize(model, (x,), [x], backend=qp.get_backend("fbgemm").with_config(config))
    assert qp.quantization_report(int8).kernels == {"2": "quantized::linear"}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.mark.parametrize("backend", ["fbgemm", "qnnpack"])
def test_an_unbatched_row_gives_an_unbatched_answer(backend):
    """nn.Linear takes one 1-D row: the int8 model raised torch's "The dimension of input tensor should
    be larger than or equal to 2" (fbgemm) / "Input tensor rank should be >= 2" (qnnpack)."""
    torch.manual_seed(0)
    model = MLP().eval()
    x = torch.randn(256, 8)
    int8 = qp.quantize(model, (x[:1],), [x], backend=backend)
    reference = qp.quantize(model, (x[:1],), [x], backend="reference")
    with torch.no_grad():
        out = int8(x[0])
        assert out.shape == model(x[0]).shape == (3,)
        assert torch.equal(out, int8(x[:1])[0])
        assert torch.allclose(out, reference(x[0]), atol=0.05)
        with pytest.raises(InputMismatchError, match=r"int8 Linear takes inputs with 8 features .*got shape \(\)"):
            int8(x[0, 0])  # a 0-d input (the float model's RuntimeError) met IndexError: tuple index out of range


class OneDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.fc(batch["num"]) + batch["bias"]


class NamedArguments(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, bias: torch.Tensor, num: torch.Tensor) -> torch.Tensor:
        return self.fc(num) + bias


class AnyArguments(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.fc(inputs[0])


def _examples(batch: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """Each model's right example (how the advice says to pass the dict)."""
    return {"OneDict": (batch,), "NamedArguments": (batch["bias"], batch["num"]), "AnyArguments": (batch["num"],)}


@pytest.mark.parametrize("model, advice", [
    (OneDict(), r"OneDict\.forward\(batch\) takes the dict as its one argument: wrap it in a tuple, \(batch,\)"),
    (AnyArguments(), r"wrap it in a tuple, \(batch,\), if forward\(\) takes the dict as one argument, else pass "
                     r"its values as a tuple in the order of forward\(\)'s arguments"),
])
def test_a_dict_example_gets_advice_that_fits_the_models_forward(model, advice):
    """The advice was always tuple(batch.values()), which calls forward(self, batch) with two arguments
    (TypeError) and swaps forward(bias, num)'s inputs when the dict holds them in another order."""
    batch = {"num": torch.randn(16, 8), "bias": torch.zeros(16, 1)}
    with pytest.raises(InputMismatchError, match=r"got a dict of keyword inputs \(num, bias\), but a graph or "
                                                 r"a comparison calls the model with positional inputs: " + advice):
        qp.quantize(model.eval(), batch, [batch], backend="fbgemm")
    with pytest.raises(InputMismatchError, match=advice):  # a calibration batch left a dict
        qp.quantize(model.eval(), _examples(batch)[type(model).__name__], [batch], backend="fbgemm")


def test_a_dict_of_forward_arguments_is_bound_to_them_and_compare_gives_advice():
    """qp.quantize binds a dict whose keys are forward()'s parameters to them by name (the W8A8 route
    takes dicts, so the graph route does too), whatever the dict's order; qp.compare, whose error read
    no forward() and gave the generic advice, names the order."""
    batch = {"num": torch.randn(16, 8), "bias": torch.randn(16, 1)}
    model = NamedArguments().eval()
    int8 = qp.quantize(model, batch, [batch], backend="fbgemm")
    positional = _examples(batch)["NamedArguments"]
    assert torch.equal(int8(*positional), qp.quantize(model, positional, [positional], backend="fbgemm")(*positional))
    torch.testing.assert_close(int8(*positional), model(*positional), atol=0.05, rtol=0)
    with pytest.raises(InputMismatchError, match=r"pass \(batch\['bias'\], batch\['num'\]\), the dict's values in "
                                                 r"the order of NamedArguments\.forward\(bias, num\)"):
        qp.compare(model, int8, batch)
