"""``qp.quantize_weights`` on plain and Hugging Face models, and ``qp.save`` / ``qp.load`` of them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import CalibrationError, ConfigValidationError, SerializationError
from qplug_core.weight_only import WeightOnlyEmbedding, WeightOnlyLinear

pytestmark = pytest.mark.usefixtures("one_thread")


def llama(seed: int = 0, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=1, n_head=4)).eval()


PROMPT = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
GREEDY = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def test_the_float_model_is_untouched_and_the_copy_keeps_generate():
    model = llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    qmodel = qp.quantize_weights(model, bits=8)
    assert type(qmodel) is type(model) and qmodel.config is not model.config
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(type(m) is not WeightOnlyLinear for m in model.modules())
    swapped = [n for n, m in qmodel.named_modules() if isinstance(m, WeightOnlyLinear)]
    assert len(swapped) == 2 * 7 + 1  # q k v o gate up down per layer, and lm_head (not tied)
    with torch.no_grad():
        assert cosine(qmodel(PROMPT).logits, model(PROMPT).logits) > 0.999
        tokens = qmodel.generate(PROMPT, **GREEDY)
    assert tokens.shape == (1, 14)


def test_hugging_face_conv1d_is_quantized_transposed_and_the_tied_head_stays_float():
    model = gpt2()
    qmodel = qp.quantize_weights(model, bits=8, embeddings=True)
    info = qmodel.qplug_weight_only
    assert info.skipped == {"lm_head": "its weight is tied to the input embedding"}
    attention = qmodel.transformer.h[0].attn.c_attn
    assert isinstance(attention, WeightOnlyLinear) and attention.from_transposed
    assert (attention.out_features, attention.in_features) == (192, 64)
    assert isinstance(qmodel.transformer.wte, WeightOnlyEmbedding)
    with torch.no_grad():
        assert cosine(qmodel(PROMPT).logits, model(PROMPT).logits) > 0.999
        qmodel.generate(PROMPT, **GREEDY)


def test_skip_takes_names_and_regular_expressions():
    qmodel = qp.quantize_weights(llama(), bits=4, group_size=32, skip=["lm_head", r"model\.layers\.\d+\.mlp\..*"])
    info = qmodel.qplug_weight_only
    assert set(info.skipped) == {"lm_head"} | {f"model.layers.{i}.mlp.{p}_proj" for i in range(2)
                                                for p in ("gate", "up", "down")}
    assert all(v == "skip= matches its name" for v in info.skipped.values())
    assert type(qmodel.model.layers[0].mlp.down_proj) is nn.Linear


def test_bad_arguments_are_refused_with_the_fix():
    model = llama()
    with pytest.raises(ConfigValidationError, match="does not divide the 64 input features of layer "
                                                    "'model.layers.0.self_attn.q_proj'.*skip="):
        qp.quantize_weights(model, bits=4, group_size=96)
    with pytest.raises(ConfigValidationError, match="did you mean 'gptq'"):
        qp.quantize_weights(model, algorithm="gtpq")
    with pytest.raises(CalibrationError, match="needs calibration"):
        qp.quantize_weights(model, algorithm="awq")


def outlier_layer():
    """A linear whose inputs have correlated features and a few large channels, as LLM
    activations do. (On independent features GPTQ has nothing to compensate with: its Hessian is
    diagonal, and it only fits noise in the calibration set.)"""
    g = torch.Generator().manual_seed(0)
    layer = nn.Linear(128, 64)
    channel_scale = torch.ones(128)
    channel_scale[:4] = 30.0
    mixing = torch.randn(32, 128, generator=g)
    data = [(torch.randn(64, 32, generator=g) @ mixing + 0.1 * torch.randn(64, 128, generator=g))
            * channel_scale for _ in range(24)]
    return layer, data


@pytest.mark.parametrize("algorithm", ["awq", "gptq"])
def test_data_aware_algorithms_beat_rtn_on_held_out_inputs(algorithm):
    layer, data = outlier_layer()
    model = nn.Sequential(layer)
    rtn = qp.quantize_weights(model, bits=4, group_size=32)
    aware = qp.quantize_weights(model, bits=4, group_size=32, algorithm=algorithm, calibration_data=data[:16])
    held_out = torch.cat(data[16:])
    with torch.no_grad():
        exact = model(held_out)
        rtn_error = float((rtn(held_out) - exact).pow(2).mean())
        aware_error = float((aware(held_out) - exact).pow(2).mean())
    assert aware_error < 0.8 * rtn_error, (aware_error, rtn_error)


def test_save_and_load_into_a_model_built_from_the_config(tmp_path):
    model = llama()
    qmodel = qp.quantize_weights(model, bits=4, group_size=32, symmetric=False, embeddings=True,
                                 algorithm="awq", calibration_data=[PROMPT])
    path = qp.save(qmodel, tmp_path / "model.safetensors")
    fresh = llama(seed=1)
    loaded = qp.load(path, model=fresh)
    assert loaded is fresh and loaded.qplug_weight_only.layers == qmodel.qplug_weight_only.layers
    assert loaded.qplug_weight_only.calibration == "block by block: 2 blocks of model.layers"
    original, restored = dict(qmodel.named_modules()), dict(loaded.named_modules())
    for name in qmodel.qplug_weight_only.layers:
        for field in ("qweight", "scales", "zero_points", "input_scale"):
            a, b = getattr(original[name], field, None), getattr(restored[name], field, None)
            assert (a is None and b is None) or torch.equal(a, b), (name, field)
    with torch.no_grad():
        torch.testing.assert_close(loaded(PROMPT).logits, qmodel(PROMPT).logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(loaded.generate(PROMPT, **GREEDY), qmodel.generate(PROMPT, **GREEDY))
    assert qp.save(loaded, tmp_path / "again.safetensors").read_bytes() == path.read_bytes()


def test_load_checks_the_model_it_fills(tmp_path):
    path = qp.save(qp.quantize_weights(llama(), bits=8), tmp_path / "model.safetensors")
    with pytest.raises(SerializationError, match="pass the model to fill"):
        qp.load(path)
    with pytest.raises(SerializationError, match="is not a module of the model given"):
        qp.load(path, model=llama(layers=1))
    other = llama()
    other.lm_head = nn.Embedding(4, 4)
    with pytest.raises(SerializationError, match="layer 'lm_head' was a linear but the model given has a "
                                                 "Embedding there"):
        qp.load(path, model=other)


def test_a_model_whose_weights_are_mostly_in_convolutions_is_told_they_stay_float(recwarn):
    """A diffusion UNet's linears hold 20% of its weights: quantize_weights left the 80% in its
    convolutions float, the result barely smaller and no faster, without a word."""
    torch.manual_seed(0)
    cnn = nn.Sequential(nn.Conv2d(16, 64, 3), nn.ReLU(), nn.Conv2d(64, 64, 3), nn.Flatten(1), nn.LazyLinear(8))
    cnn(torch.randn(1, 16, 8, 8))
    mlp = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    qp.quantize_weights(cnn.eval())
    qp.quantize_weights(mlp.eval())
    told = [str(w.message) for w in recwarn if "convolution(s) hold" in str(w.message)]
    assert len(told) == 1 and "2 convolution(s) hold 85% of its weights" in told[0] and "qp.quantize" in told[0]


class _Recommender(nn.Module):
    """A DLRM in small: a table of 32-wide rows beside linears of 13 and 20 input features."""

    def __init__(self):
        super().__init__()
        self.table = nn.EmbeddingBag(100, 32, mode="sum")
        self.bot = nn.Linear(13, 32)
        self.top = nn.Linear(64, 1)

    def forward(self, dense, ids, offsets):
        return self.top(torch.cat([self.bot(dense), self.table(ids, offsets)], dim=1))


def test_linears_false_quantizes_only_the_tables_and_checks_the_group_size_on_them_alone():
    torch.manual_seed(0)
    model = _Recommender().eval()
    with pytest.raises(ConfigValidationError, match=r"13 input features of layer 'bot'.*linears=False"):
        qp.quantize_weights(model, bits=4, group_size=32, embeddings=True)
    qmodel = qp.quantize_weights(model, bits=4, group_size=32, embeddings=True, linears=False)
    assert qmodel.qplug_weight_only.layers == {"table": "embedding_bag"}
    assert type(qmodel.bot) is nn.Linear and type(qmodel.top) is nn.Linear
    dense, ids, offsets = torch.randn(4, 13), torch.randint(0, 100, (12,)), torch.tensor([0, 3, 6, 9])
    expected = model.top(torch.cat([model.bot(dense), nn.functional.embedding_bag(
        ids, qmodel.table.quantized_weight().dequantize(), offsets, mode="sum")], dim=1))
    with torch.no_grad():
        torch.testing.assert_close(qmodel(dense, ids, offsets), expected, rtol=0, atol=2e-3)  # 4-bit: float16 scales
    with pytest.raises(ConfigValidationError, match="embeddings=True to quantize only the embedding tables"):
        qp.quantize_weights(model, linears=False)


@pytest.mark.parametrize("bits", [8, 4])
def test_tables_refuse_the_ids_the_float_tables_refuse(bits):
    class Tables(nn.Module):
        def __init__(self):
            super().__init__()
            self.lookup, self.bag = nn.Embedding(10, 8), nn.EmbeddingBag(10, 8, mode="sum")

        def forward(self, ids):
            return self.lookup(ids).sum(1) + self.bag(ids)

    model = Tables().eval()
    qmodel = qp.quantize_weights(model, bits=bits, embeddings=True)
    good = torch.tensor([[0, 9, 3]])
    assert torch.allclose(qmodel(good), model(good), atol=0.05 if bits == 8 else 0.5)
    for bad in (-1, 10):  # -1 gave the last row: indexing counts it from the end
        ids = torch.tensor([[0, bad, 3]])
        with pytest.raises((IndexError, RuntimeError)):
            model(ids)
        with pytest.raises(IndexError, match="out of range"):
            qmodel(ids)
