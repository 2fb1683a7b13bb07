"""``qp.save`` / ``qp.load`` of ``qp.quantize_dynamic`` models whose LSTMs / GRUs / RNN cells are
int8 or float16: the same weights and outputs after load, a file of int8 (float16) weights, and the
layer's options checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import SerializationError
from qplug_core.kernels.cpu import override_cpu_flags

pytestmark = pytest.mark.usefixtures("plugin_autoload")
VNNI = "avx512f avx512bw avx512vl avx512_vnni avx2 fma"


class Tagger(nn.Module):
    """A recurrent layer and a linear head, as a speech or tagging model has."""

    def __init__(self, rnn: type[nn.Module], seed: int = 0, **options) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.rnn = rnn(16, 32, **options)
        self.head = nn.Linear(64 if options.get("bidirectional") else 32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


CASES = [
    (nn.LSTM, dict(num_layers=2, batch_first=True), "fbgemm", False, False),
    (nn.GRU, dict(bidirectional=True, bias=False), "fbgemm", True, True),
    (nn.LSTM, dict(bidirectional=True), "qnnpack", None, None),  # the backend's defaults
]


@pytest.mark.parametrize("rnn, options, backend, per_channel, reduce_range", CASES)
def test_a_dynamic_rnn_model_loads_with_the_same_integers_and_outputs(tmp_path, rnn, options, backend, per_channel,
                                                                      reduce_range):
    from qplug_core.config.defaults import dynamic_qconfig

    qconfig = None if per_channel is None else dynamic_qconfig(per_channel=per_channel, reduce_range=reduce_range)
    qmodel = qp.quantize_dynamic(Tagger(rnn, **options).eval(), qconfig and {rnn: qconfig, nn.Linear: qconfig},
                                 backend=backend)
    path = qp.save(qmodel, tmp_path / "tagger.safetensors")
    with override_cpu_flags(VNNI):  # where 8-bit activations stay 8-bit (else: the last test)
        loaded = qp.load(path, model=Tagger(rnn, seed=3, **options).eval())
    assert type(loaded.rnn) is type(qmodel.rnn) and loaded.rnn.engine == qmodel.rnn.engine
    assert loaded.rnn.reduce_range == qmodel.rnn.reduce_range
    saved, restored = qmodel.rnn.stored_weights(), loaded.rnn.stored_weights()
    assert list(saved) == list(restored)
    for (weight, bias), (weight_again, bias_again) in zip(saved.values(), restored.values()):
        assert weight.per_channel == weight_again.per_channel and per_channel in (None, weight.per_channel)
        assert all(torch.equal(a, b) for a, b in zip(weight[:3], weight_again[:3]))
        assert torch.equal(bias, bias_again)
    x = torch.randn(3, 7, 16)
    with torch.no_grad():
        assert torch.equal(loaded(x), qmodel(x))
    assert qp.save(loaded, tmp_path / "again.safetensors").read_bytes() == path.read_bytes()


@pytest.mark.parametrize("dtype, low, high", [(torch.qint8, 0.2, 0.3), (torch.float16, 0.45, 0.55)])
def test_the_file_holds_int8_or_float16_weights(tmp_path, dtype, low, high):
    """About a quarter (a half) of the float weights' bytes (the biases stay float)."""
    model = Tagger(nn.LSTM, num_layers=2).eval()
    model.rnn = nn.LSTM(16, 128, num_layers=2)
    model.head = nn.Identity()
    float_bytes = sum(p.numel() * 4 for p in model.parameters())
    path = qp.save(qp.quantize_dynamic(model, dtype=dtype, backend="fbgemm"), tmp_path / "lstm.safetensors")
    assert low * float_bytes < path.stat().st_size < high * float_bytes


def test_a_model_with_other_rnn_options_is_refused_and_left_as_it_was(tmp_path):
    qmodel = qp.quantize_dynamic(Tagger(nn.LSTM, batch_first=True).eval(), backend="fbgemm")
    path = qp.save(qmodel, tmp_path / "tagger.safetensors")
    other = Tagger(nn.LSTM).eval()
    with pytest.raises(SerializationError, match=r"layer 'rnn' has options .*'batch_first': True.* in the file "
                                                 r"but .*'batch_first': False.* in the model given"):
        qp.load(path, model=other)
    assert type(other.rnn) is nn.LSTM


class Cells(nn.Module):
    """The three cells one after another, stepped twice; ``bias`` and ``nonlinearity`` as given."""

    def __init__(self, seed: int = 0, bias: bool = True, nonlinearity: str = "tanh") -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lstm = nn.LSTMCell(16, 96, bias=bias)
        self.gru = nn.GRUCell(96, 96)
        self.rnn = nn.RNNCell(96, 32, nonlinearity=nonlinearity)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, c = self.lstm(x)
        h, _ = self.lstm(x, (h, c))
        g = self.gru(h, self.gru(h))
        return self.rnn(g, self.rnn(g))


HALF_CASES = [(Tagger, dict(rnn=nn.LSTM, num_layers=2, bidirectional=True)), (Tagger, dict(rnn=nn.GRU)),
              (Cells, dict(bias=False, nonlinearity="relu"))]


@pytest.mark.parametrize("build, options", HALF_CASES)
def test_a_float16_dynamic_model_loads_with_the_same_weights_and_outputs(tmp_path, build, options):
    """Float16 weights are stored as float16 (half the float bytes) and packed again as such."""
    qmodel = qp.quantize_dynamic(build(**options).eval(), dtype=torch.float16, backend="fbgemm")
    path = qp.save(qmodel, tmp_path / "half.safetensors")
    loaded = qp.load(path, model=build(seed=3, **options).eval())
    kernels = [(name, m) for name, m in qmodel.named_modules() if hasattr(m, "dtype")]
    for name, kernel in kernels:
        restored = loaded.get_submodule(name)
        assert type(restored) is type(kernel) and restored.dtype == torch.float16
        saved = kernel.stored_weights() if hasattr(kernel, "stored_weights") else {"": (kernel.stored_weight(), None)}
        again = restored.stored_weights() if hasattr(restored, "stored_weights") else {"": (restored.stored_weight(), None)}
        for (weight, bias), (weight_again, bias_again) in zip(saved.values(), again.values(), strict=True):
            assert weight.half.dtype == torch.float16 and torch.equal(weight.half, weight_again.half)
            assert (bias is None and bias_again is None) or torch.equal(bias, bias_again)
    x = torch.randn(3, 7, 16) if build is Tagger else torch.randn(3, 16)
    with torch.no_grad():
        assert torch.equal(loaded(x), qmodel(x))


@pytest.mark.parametrize("backend", ["fbgemm", "qnnpack"])
def test_int8_cells_load_with_the_same_integers_and_outputs(tmp_path, backend):
    qmodel = qp.quantize_dynamic(Cells(bias=False).eval(), backend=backend)
    path = qp.save(qmodel, tmp_path / "cells.safetensors")
    loaded = qp.load(path, model=Cells(seed=3, bias=False).eval())
    for name in ("lstm", "gru", "rnn"):
        kernel, restored = qmodel.get_submodule(name), loaded.get_submodule(name)
        assert type(restored) is type(kernel) and restored.engine == backend
        for (weight, bias), (weight_again, bias_again) in zip(kernel.stored_weights().values(),
                                                              restored.stored_weights().values(), strict=True):
            assert all(torch.equal(a, b) for a, b in zip(weight[:3], weight_again[:3]))
            assert (bias is None and bias_again is None) or torch.equal(bias, bias_again)
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert torch.equal(loaded(x), qmodel(x))
    # int8 weights, and per-channel scales and zero points at 16 bytes a row
    assert path.stat().st_size < 0.35 * sum(p.numel() * 4 for p in Cells(bias=False).parameters())
    assert qp.save(loaded, tmp_path / "again.safetensors").read_bytes() == path.read_bytes()


@pytest.mark.parametrize("other, message", [
    (dict(bias=True), r"layer 'lstm' has options .*'bias': False.* in the file but .*'bias': True"),
    (dict(bias=False, nonlinearity="relu"), r"layer 'rnn' has options .*'tanh'.* in the file but .*'relu'"),
])
def test_a_model_with_other_cell_options_is_refused_and_left_as_it_was(tmp_path, other, message):
    path = qp.save(qp.quantize_dynamic(Cells(bias=False).eval(), dtype=torch.float16, backend="fbgemm"),
                   tmp_path / "cells.safetensors")
    model = Cells(**other).eval()
    with pytest.raises(SerializationError, match=message):
        qp.load(path, model=model)
    assert [type(m) for m in model.children()] == [nn.LSTMCell, nn.GRUCell, nn.RNNCell]


def test_the_reference_simulation_is_refused_with_the_way_out(tmp_path):
    qmodel = qp.quantize_dynamic(Tagger(nn.LSTM).eval(), {nn.LSTM}, backend="reference")
    with pytest.raises(SerializationError, match="layer 'rnn' is a dynamic SimulatedDynamic.*float simulation.*"
                                                 "backend='fbgemm'.*run qp.quantize_dynamic again"):
        qp.save(qmodel, tmp_path / "lstm.safetensors")


@pytest.fixture
def half_cells(tmp_path) -> Path:
    """A file of float16 cells, the LSTM cell without biases."""
    model = qp.quantize_dynamic(Cells(bias=False).eval(), dtype=torch.float16, backend="fbgemm")
    return qp.save(model, tmp_path / "cells.safetensors")


def _edited(path: Path, edit) -> Path:
    """A copy of ``path`` whose document and tensors went through ``edit`` (no digest: as files
    written before digests, so only the checks under test can refuse it)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as f:
        document = json.loads(f.metadata()["qplug"])
        tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    edit(document, tensors)
    out = path.with_name("edited.safetensors")
    save_file(tensors, str(out), metadata={"qplug": json.dumps(document)})
    return out


def _set(key: str, change):
    def edit(document, tensors):
        tensors[key] = change(tensors[key])
    return edit


def _layer(name: str, **fields):
    def edit(document, tensors):
        next(layer for layer in document["layers"] if layer["name"] == name).update(fields)
    return edit


def _inf(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.clone()
    tensor[0, 0] = float("inf")
    return tensor


HALF = "quantized/{}.weight_float16"
EDITS = {
    "float16 weight stored as float32": (_set(HALF.format("gru/weight_hh"), torch.Tensor.float),
                                         r"layer 'gru.weight_hh' weight_float16 should be torch.float16 \(288, 96\), "
                                         r"got torch.float32"),
    "a row less": (_set(HALF.format("rnn/weight_ih"), lambda t: t[1:]), r"'rnn.weight_ih' weight_float16 should be"),
    "an infinite weight": (_set(HALF.format("lstm/weight_ih"), _inf), r"'lstm.weight_ih' weight_float16 has values "
                                                                     "that are not finite"),
    "unknown weight dtype": (_layer("gru", weight_dtype="bfloat16"), r"layer 'gru.weight_ih' has weight_dtype 'bfloat16'"),
    "a bias for a bias-free cell": (lambda d, t: t.update({"quantized/lstm/bias_ih": torch.zeros(384)}),
                                    r"layer 'lstm' has bias_ih in the file but no bias in the model given"),
    "an int8 layer without its scales": (_layer("rnn", weight_dtype="qint8", per_channel=True),
                                         r"layer 'rnn.weight_ih' weight_int8 should be torch.int8 \(32, 96\), got "
                                         "missing"),
}


@pytest.mark.parametrize("case", list(EDITS))
def test_a_damaged_float16_or_cell_layer_is_refused_naming_it(half_cells, case):
    edit, message = EDITS[case]
    model = Cells(bias=False).eval()
    with pytest.raises(SerializationError, match=message):
        qp.load(_edited(half_cells, edit), model=model)
    assert [type(m) for m in model.children()] == [nn.LSTMCell, nn.GRUCell, nn.RNNCell]


def test_float16_weights_on_an_engine_that_cannot_pack_them_are_refused(half_cells):
    from qplug_core.kernels.capabilities import engine_capabilities

    if "qnnpack" not in torch.backends.quantized.supported_engines or \
            engine_capabilities("qnnpack").fp16_dynamic_linear:
        pytest.skip("needs a qnnpack engine without float16 weights")
    with pytest.raises(SerializationError, match="layer 'gru' holds float16 weights, which engine 'qnnpack' "
                                                 "cannot pack"):
        qp.load(_edited(half_cells, _layer("gru", engine="qnnpack")), model=Cells(bias=False).eval())


def test_8_bit_activations_load_as_7_bits_where_the_kernels_sum_pairs_in_int16(tmp_path):
    """A file saved where fbgemm sums in int32 (VNNI) held 8-bit activations, which an x86 CPU
    without VNNI sums in saturating int16 pairs: its layers load with 7-bit activations, saying so."""
    from qplug_core.config.defaults import dynamic_qconfig

    full = dynamic_qconfig(per_channel=False, reduce_range=False)
    qmodel = qp.quantize_dynamic(Cells().eval(), dict.fromkeys((nn.LSTMCell, nn.GRUCell, nn.RNNCell), full),
                                 backend="fbgemm")
    path = qp.save(qmodel, tmp_path / "cells.safetensors")
    x = torch.randn(4, 16)
    with override_cpu_flags("avx2 fma"), pytest.warns(UserWarning, match=r"3 dynamic int8 layer\(s\) \('lstm', "
                                                                          r"'gru', 'rnn'\) were saved with 8-bit"):
        narrowed = qp.load(path, model=Cells().eval())
    assert all(narrowed.get_submodule(name).reduce_range for name in ("lstm", "gru", "rnn"))
    with torch.no_grad():
        assert torch.allclose(narrowed(x), qmodel(x), atol=0.05) and not torch.equal(narrowed(x), qmodel(x))
    with override_cpu_flags(VNNI):
        kept = qp.load(path, model=Cells().eval())
    assert not any(kept.get_submodule(name).reduce_range for name in ("lstm", "gru", "rnn"))
    with torch.no_grad():
        assert torch.equal(kept(x), qmodel(x))
