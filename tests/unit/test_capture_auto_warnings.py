"""``capture="auto"`` says once when it takes another capture than symbolic tracing for a reason the
docs do not give, or leaves part of the model float (``qplug_core/flows/capture.py``).

A None example input and ``nn.Transformer*`` modules sent the model to torch.export without a word,
and when that export failed, auto traced symbolically all the same: the transformer's projections
stayed float, a None input was traced as a tensor, and both capturing ways failing left submodules
float with only the report saying so. Symbolic tracing failing and torch.export taking the model
(every Hugging Face transformer) is the documented default: it says nothing unless an image's size
gets fixed (``tests/regressions/test_dense_prediction_reports.py``).
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import nn

from qplug_core.errors import TraceError
from qplug_core.flows.capture import capture_for_quantization
from qplug_core.flows.tags import CAPTURE, CAPTURE_SKIPPED


class OptionalMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, mask=None):
        y = self.fc(x)
        return y if mask is None else y * mask


class NoFakeTensors(OptionalMask):
    """Reads a data pointer first: torch.export's fake tensors have none, symbolic tracing records it."""

    def forward(self, x, mask=None):
        return super().forward(x + 0 * x.data_ptr(), mask)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 1,
                                         enable_nested_tensor=False)

    def forward(self, x):
        return self.enc(x + 0 * x.data_ptr())


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(x) if x.sum() > 0 else -self.fc(x)


class TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(16, 16), Branchy()

    def forward(self, x):
        return self.second(self.first(x))


class IteratesChunks(nn.Module):
    """Symbolic tracing cannot iterate a Proxy; torch.export takes it (the documented fallback)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        a, b = list(self.fc(x).chunk(2, 1))
        return a * b


def _captured(model: nn.Module, example: tuple):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = capture_for_quantization(model.eval(), example)
    return gm, [str(w.message) for w in caught if str(w.message).startswith("qplug:")]


@pytest.mark.slow  # one torch.export that succeeds: 2-8 s on the shared machine
def test_a_none_example_input_sent_to_export_says_so():
    gm, said = _captured(OptionalMask(), (torch.randn(4, 16), None))
    assert gm.meta[CAPTURE] == "export" and len(said) == 1
    assert "example input 'mask' of OptionalMask is None" in said[0] and "capture='export'" in said[0]


def test_a_none_example_input_traced_symbolically_after_export_failed_says_so():
    with pytest.warns(UserWarning, match=r"'mask' of NoFakeTensors is None.*torch.export could not capture the "
                                         r"model \(.*data pointer.*capture='auto' traced it symbolically") as caught:
        gm = capture_for_quantization(NoFakeTensors().eval(), (torch.randn(4, 16), None))
    assert gm.meta[CAPTURE] == "symbolic"
    assert sum(str(w.message).startswith("qplug:") for w in caught) == 1


def test_transformer_modules_left_float_when_export_fails_say_so():
    with pytest.warns(UserWarning, match=r"Encoder holds TransformerEncoder 'enc', whose linear projections only a "
                                         r"torch.export capture can quantize.*these modules stay float.*"
                                         r"capture='symbolic'"):
        gm = capture_for_quantization(Encoder().eval(), (torch.randn(2, 5, 16),))
    assert gm.meta[CAPTURE] == "symbolic"


def test_submodules_kept_opaque_when_neither_capture_works_say_so():
    with pytest.warns(UserWarning, match=r"neither symbolic tracing nor torch.export captures TwoBlocks whole.*"
                                         r"keeps Branchy 'second' float.*non_traceable_module_names=\['second'\]"):
        gm = capture_for_quantization(TwoBlocks().eval(), (torch.randn(4, 16),))
    assert [name for name, _, _ in gm.meta[CAPTURE_SKIPPED]] == ["second"]


@pytest.mark.slow  # one torch.export that succeeds: 2-8 s on the shared machine
def test_the_documented_export_fallback_says_nothing():
    gm, said = _captured(IteratesChunks(), (torch.randn(4, 16),))
    assert gm.meta[CAPTURE] == "export" and said == []


def test_a_model_that_traces_with_no_none_input_says_nothing():
    gm, said = _captured(OptionalMask(), (torch.randn(4, 16),))  # mask left out: its default, traced as a constant
    assert gm.meta[CAPTURE] == "symbolic" and said == []


def _options_popped(forward):
    """Hugging Face's call-option decorator, around a forward taking **kwargs: torch.fx fails inside."""
    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        kwargs.pop("return_dict", None)
        return forward(self, *args, **kwargs)
    return wrapper


class DecoratedConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    @_options_popped
    def forward(self, pixel_values, scale=None, **kwargs):
        return self.conv(pixel_values)


class DecoratedChunks(DecoratedConv):
    @_options_popped
    def forward(self, pixel_values, scale=None, **kwargs):
        a, b = list(self.conv(pixel_values).chunk(2, 1))  # a Proxy cannot be iterated: torch.export takes it
        return a * b


def test_a_decorated_forward_refused_by_symbolic_tracing_says_why():
    with pytest.raises(TraceError, match=r"cannot trace DecoratedConv symbolically: a decorator wraps its forward, "
                                         r"which takes \*args or \*\*kwargs, and torch.fx cannot trace that pair"):
        capture_for_quantization(DecoratedConv().eval(), (torch.randn(1, 3, 8, 8),), level="symbolic")


@pytest.mark.slow  # one torch.export that succeeds: 2-8 s on the shared machine
def test_an_export_fallback_warning_names_where_not_the_tracer_error():
    gm, said = _captured(DecoratedChunks(), (torch.randn(1, 3, 8, 8),))
    assert gm.meta[CAPTURE] == "export" and len(said) == 1
    assert said[0].startswith("qplug: DecoratedChunks: its forward does not trace symbolically, so capture='auto'")
    assert "TraceError" not in said[0] and "Proxy" not in said[0]
