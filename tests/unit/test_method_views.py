"""qp.quantize of a bound method or a functools.partial: the method's computation in int8, the
user's model untouched (qplug_core/flows/method_views.py). CLIP's get_image_features and
get_text_features are asserted by docs_src/export_methods.py (tests/docs)."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import ConfigValidationError, InputMismatchError

pytestmark = pytest.mark.usefixtures("plugin_autoload", "one_thread")


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()


class _TwoHeads(nn.Module):
    """forward and a second method sharing a trunk, as a retrieval model's towers do."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.head, self.other = nn.Linear(16, 16), nn.Linear(16, 4), nn.Linear(16, 8)

    def forward(self, x):
        return self.head(torch.relu(self.trunk(x)))

    def embed(self, x, scale: float = 1.0):
        return self.other(torch.relu(self.trunk(x))) * scale

    def proba(self, x):  # a method built on forward, as predict_proba is
        return torch.softmax(self(x), dim=-1)

    def proba_of_forward(self, x):
        return torch.softmax(self.forward(x), dim=-1)


@pytest.fixture(scope="module")
def two_heads():
    torch.manual_seed(0)
    return _TwoHeads().eval(), [(torch.randn(4, 16),) for _ in range(3)]


def test_a_bound_method_is_quantized_as_forward(two_heads):
    model, batches = two_heads
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q = qp.quantize(model.embed, batches[0], batches, backend="fbgemm")
    assert not [w for w in caught if "not on it" in str(w.message)]  # the method asked for is the graph
    x = batches[1][0]
    assert q(x).shape == (4, 8)
    assert _cosine(q(x), model.embed(x)) > 0.999
    assert qp.quantization_report(q).kernels["other"] == "quantized::linear"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert type(model) is _TwoHeads and model(x).shape == (4, 4)  # the user's model as it was


def test_the_whole_model_quantized_names_the_methods_its_graph_lacks(two_heads):
    """A whole CLIPModel came back without get_text_features / get_image_features, with nothing said."""
    model, batches = two_heads
    with pytest.warns(UserWarning, match=r"qp.quantize returns a GraphModule of _TwoHeads.forward only: embed\(\), "
                                         r"proba\(\), proba_of_forward\(\) are not on it\. Quantize a method as its "
                                         r"own graph with qp.quantize\(model.embed, .*module-swap route"):
        q = qp.quantize(model, batches[0], batches, backend="fbgemm")
    assert not any(hasattr(q, name) for name in ("embed", "proba", "proba_of_forward"))


@pytest.mark.parametrize("method", ["proba", "proba_of_forward"])
def test_a_method_calling_forward_reaches_the_models_forward(two_heads, method):
    model, batches = two_heads  # the view's forward is the method: self(x) in it used to recurse
    q = qp.quantize(getattr(model, method), batches[0], batches, backend="fbgemm")
    x = batches[1][0]
    expected = getattr(model, method)(x)
    assert torch.allclose(q(x).sum(-1), torch.ones(4), atol=1e-5)
    assert _cosine(q(x), expected) > 0.999 and (q(x) - expected).abs().max() < 0.02
    assert qp.quantization_report(q).kernels["head"] == "quantized::linear"


def test_a_partial_keyword_the_method_does_not_take_is_named(two_heads):
    model, batches = two_heads
    with pytest.raises(ConfigValidationError, match=r"_TwoHeads.embed\(\) has no parameter 'scal' "
                                                    r"\(did you mean 'scale'\?\)"):
        qp.quantize(functools.partial(model.embed, scal=2.0), batches[0], batches, backend="fbgemm")


@pytest.mark.slow  # a partial's forward takes *args: captured by torch.export (2-4 s here)
def test_a_partial_fixes_its_keywords_and_the_int8_model_takes_them(two_heads):
    model, batches = two_heads
    q = qp.quantize(functools.partial(model.embed, scale=2.0), batches[0], batches, backend="fbgemm")
    x = batches[1][0]
    assert _cosine(q(x, scale=2.0), model.embed(x, scale=2.0)) > 0.999
    with pytest.raises(InputMismatchError, match=r"functools.partial\(model, scale=1.0\)"):
        q(x, scale=1.0)
    with pytest.raises(ConfigValidationError, match="keyword arguments only"):
        qp.quantize(functools.partial(model.embed, batches[0][0]), (), batches, backend="fbgemm")


def test_other_entry_points_say_that_qp_quantize_takes_a_method(two_heads):
    model, batches = two_heads
    with pytest.raises(ConfigValidationError, match=r"_TwoHeads.embed; qp.quantize takes it"):
        qp.prepare_fx(model.embed, None, batches[0], backend="fbgemm")


@pytest.mark.slow  # captured by torch.export, as every partial (2-4 s here)
def test_a_partial_fixing_a_0_dim_tensor_takes_a_call_giving_it(two_heads):
    model, batches = two_heads
    q = qp.quantize(functools.partial(model.embed, scale=torch.tensor(2.0)), batches[0], batches, backend="fbgemm")
    x = batches[1][0]
    assert torch.equal(q(x, scale=torch.tensor(2.0)), q(x))
    assert _cosine(q(x), model.embed(x, scale=torch.tensor(2.0))) > 0.999
    with pytest.raises(InputMismatchError, match="scale was fixed at 2.0"):
        q(x, scale=torch.tensor(3.0))
