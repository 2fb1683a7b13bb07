"""Tampered numbers, files that are not files, and small files asking for huge modules (issue 17).

Every case starts from a real file written by ``qp.save`` and edits its JSON header and tensors
the way an attacker would; ``qp.load`` must refuse it with a :class:`SerializationError` that names
the file and the field, before anything computes with the value.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from artifactkit import module, reference_model, rewrite
from torch import fx, nn

import qplug_core as qp
from qplug_core.errors import SerializationError
from qplug_core.serialization import load, save
from qplug_core.serialization.module_codec import WORK_PER_TENSOR


@pytest.fixture
def good_file(tmp_path: Path) -> Path:
    return save(reference_model(), tmp_path / "good.safetensors")


Edit = Callable[[dict[str, Any], dict[str, torch.Tensor]], None]


def tensor(key: str, value: torch.Tensor) -> Edit:
    """Replace tensor ``key`` (and its table entry, so the file is self-consistent)."""
    def edit(document, tensors):
        tensors[key] = value
        document["model"]["tensors"][key] = {"dtype": str(value.dtype), "shape": list(value.shape)}
    return edit


def attr(path: str, **values: Any) -> Edit:
    def edit(document, tensors):
        module(document, path)["attrs"].update(values)
    return edit


SCALE, ZERO_POINT = "quantize.scale", "quantize.zero_point"
WEIGHT_SCALE = "fc.weight_qparams_holder.scale"
WEIGHT_ZERO_POINT = "fc.weight_qparams_holder.zero_point"

TAMPERED = {
    # scales
    "scale NaN": (tensor(SCALE, torch.tensor(float("nan"))), "modules[quantize].scale", "nan"),
    "scale +Inf": (tensor(SCALE, torch.tensor(float("inf"))), "modules[quantize].scale", "inf"),
    "scale -Inf": (tensor(SCALE, torch.tensor(float("-inf"))), "modules[quantize].scale", "-inf"),
    "scale 0": (tensor(SCALE, torch.tensor(0.0)), "modules[quantize].scale", "scale 0.0"),
    "scale negative": (tensor(SCALE, torch.tensor(-0.05)), "modules[quantize].scale", "-0.05"),
    "scale denormal": (tensor(SCALE, torch.tensor(1e-40)), "modules[quantize].scale", "normal"),
    "weight scale NaN in one channel": (tensor(WEIGHT_SCALE, torch.tensor([0.02, float("nan"), 0.02])),
                                        "modules[fc.weight_qparams_holder].scale", "nan"),
    "weight scale denormal": (tensor(WEIGHT_SCALE, torch.tensor([0.02, 0.02, 1e-45])),
                              "modules[fc.weight_qparams_holder].scale", "normal"),
    # zero points
    "zero_point above quint8": (tensor(ZERO_POINT, torch.tensor(300)), "modules[quantize].zero_point",
                                "outside the range [0, 255]"),
    "zero_point below quint8": (tensor(ZERO_POINT, torch.tensor(-1)), "modules[quantize].zero_point",
                                "outside the range [0, 255]"),
    "weight zero_point above qint8": (tensor(WEIGHT_ZERO_POINT, torch.tensor([0, 128, 0])),
                                      "modules[fc.weight_qparams_holder].zero_point", "[-128, 127]"),
    # quant_min / quant_max
    "quant_max above quint8": (attr("quantize", quant_max=256), "modules[quantize].quant_max", "256"),
    "quant_min below quint8": (attr("quantize", quant_min=-1), "modules[quantize].quant_min", "-1"),
    "quant_min above quant_max": (attr("quantize", quant_min=200, quant_max=100),
                                  "modules[quantize].quant_min", "above quant_max"),
    "quant_max a float": (attr("quantize", quant_max=255.5), "modules[quantize].quant_max", "255.5"),
    "weight quant_min below qint8": (attr("fc.weight_qparams_holder", quant_min=-129),
                                     "modules[fc.weight_qparams_holder].quant_min", "-129"),
    # qparams of the wrong dtype
    "scale float64": (tensor(SCALE, torch.tensor(0.05, dtype=torch.float64)), "modules[quantize].scale",
                      "torch.float64"),
    "zero_point int32": (tensor(ZERO_POINT, torch.tensor(128, dtype=torch.int32)),
                         "modules[quantize].zero_point", "torch.int32"),
    "qparams dtype not quantized": (attr("quantize", dtype={"dtype": "torch.int64"}),
                                    "modules[quantize].dtype", "not a quantized dtype"),
    "per-tensor scale with 2 elements": (tensor(SCALE, torch.tensor([0.05, 0.05])),
                                         "modules[quantize].scale", "one element"),
    # weight and bias shapes
    "per-channel scales do not fit the weight": (
        lambda d, t: (tensor(WEIGHT_SCALE, torch.full((4,), 0.02))(d, t),
                      tensor(WEIGHT_ZERO_POINT, torch.zeros(4, dtype=torch.int64))(d, t)),
        "modules[fc].weight_qparams_holder.axis", "do not fit a weight of shape (3, 4)"),
    "bias of the wrong shape": (tensor("fc.module.bias", torch.zeros(4)), "fc.module", "expects (3,)"),
    "weight of the wrong shape": (lambda d, t: (t.update({"fc.module.weight": torch.zeros(3, 5, dtype=torch.int8)}),
                                                d["model"]["tensors"]["fc.module.weight"].update(shape=[3, 5])),
                                  "fc.module", "expects (3, 4)"),
    "layer sizes edited to fit nothing": (
        lambda d, t: module(d, "fc.module")["kwargs"].update(in_features=5),
        "fc.module", "expects (3, 5)"),
}


@pytest.mark.parametrize("case", list(TAMPERED))
def test_tampered_value_is_refused_naming_the_field(case, good_file):
    edit, field, detail = TAMPERED[case]
    path = rewrite(good_file, edit)
    with pytest.raises(SerializationError) as info:
        load(path)
    message = str(info.value)
    assert str(path) in message
    assert field in message, message
    assert detail in message, message


def test_untampered_rewrite_loads(good_file):
    """The control: rewriting the file without changes gives a model that loads and runs."""
    loaded = load(rewrite(good_file, lambda d, t: None))
    x = torch.randn(2, 4)
    torch.testing.assert_close(loaded(x), reference_model()(x))


@pytest.fixture
def recurrent_file(tmp_path: Path) -> Path:
    """A dynamic LSTM's reference form, per-channel qparams recorded for each weight matrix."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(4, 6)

        def forward(self, x):
            return self.rnn(x)[0]

    torch.manual_seed(0)
    x = torch.randn(5, 2, 4)
    observed = qp.prepare_fx(Net().eval(), qp.get_default_qconfig_mapping("reference", "dynamic"), (x,),
                             backend="reference")
    qp.calibrate(observed, [(x,)], progress=False)
    return save(qp.convert_to_reference_fx(observed), tmp_path / "lstm.safetensors")


HOLDERS = "rnn.weight_qparams_holders"


@pytest.mark.parametrize("edit, field, detail", [
    (lambda d, t: module(d, f"{HOLDERS}.weight_hh_l0").update(path=f"{HOLDERS}.weight_hh_l9"),
     "modules[rnn].weight_qparams_holders.weight_hh_l9", "LSTM has no weight matrix 'weight_hh_l9'"),
    (lambda d, t: (tensor(f"{HOLDERS}.weight_ih_l0.scale", torch.full((3,), 0.02))(d, t),
                   tensor(f"{HOLDERS}.weight_ih_l0.zero_point", torch.zeros(3, dtype=torch.int64))(d, t)),
     "modules[rnn].weight_qparams_holders.weight_ih_l0.axis",
     "3 channels along axis 0 do not fit a weight of shape (24, 4)"),
], ids=["names a matrix the layer lacks", "channels that do not fit the matrix"])
def test_tampered_recurrent_weight_qparams_are_refused_naming_the_field(edit, field, detail, recurrent_file):
    """Lowering packs each matrix of the layer with the qparams recorded for it: they must be there."""
    assert load(rewrite(recurrent_file, lambda d, t: None)) is not None  # the control loads
    path = rewrite(recurrent_file, edit)
    with pytest.raises(SerializationError) as info:
        load(path)
    message = str(info.value)
    assert str(path) in message and field in message and detail in message, message


def test_recurrent_weights_are_stored_as_int8_and_older_float_files_load(recurrent_file):
    """The LSTM's weight matrices lie on their int8 grids and are stored so (the file held them
    float, 4x the bytes of what ONNX Runtime and the kernels run); files written then still load."""
    from safetensors import safe_open

    matrices = [f"rnn.module.{name}" for name in ("weight_ih_l0", "weight_hh_l0")]
    with safe_open(str(recurrent_file), "pt") as f:
        assert [f.get_slice(key).get_dtype() for key in matrices] == ["I8", "I8"]
    loaded = load(recurrent_file)

    def as_written_before(document, tensors):
        for key in matrices:
            tensors[key] = loaded.get_parameter(key).detach().clone()
            document["model"]["tensors"][key] = {"dtype": "torch.float32", "shape": list(tensors[key].shape)}

    older = load(rewrite(recurrent_file, as_written_before))
    x = torch.randn(5, 2, 4)
    assert torch.equal(older(x), loaded(x))
    for key in matrices:
        assert torch.equal(older.get_parameter(key), loaded.get_parameter(key))


# -- files that are not regular files --------------------------------------------------------------


def _load_in_thread(path: Path) -> BaseException | None:
    """``load(path)`` in a daemon thread: a FIFO would block the open forever if it were opened."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            load(path)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            outcome.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(60)
    assert outcome, f"qp.load({path}) is still blocked after 60 s"
    return outcome[0]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX only")
def test_fifo_is_refused_without_opening_it(tmp_path):
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    error = _load_in_thread(fifo)
    assert isinstance(error, SerializationError) and "is a FIFO (named pipe), not a regular file" in str(error)


@pytest.mark.parametrize(("path", "kind"), [("/dev/zero", "a character device"),
                                            ("/dev/null", "a character device")])
def test_device_is_refused(path, kind):
    if not os.path.exists(path):
        pytest.skip(f"{path} does not exist here")
    error = _load_in_thread(Path(path))
    assert isinstance(error, SerializationError) and f"is {kind}, not a regular file" in str(error)


def test_directory_is_refused(tmp_path):
    with pytest.raises(SerializationError, match="is a directory, not a regular file"):
        load(tmp_path)


def test_symlink_to_a_regular_file_loads(good_file, tmp_path):
    link = tmp_path / "link.safetensors"
    link.symlink_to(good_file)
    assert isinstance(load(link), fx.GraphModule)


# -- small files asking for huge modules -----------------------------------------------------------


def _add_module(entry: dict[str, Any]) -> Edit:
    def edit(document, tensors):
        document["model"]["modules"].append(entry)
    return edit


def test_small_file_cannot_build_a_transformer_with_20000_layers(good_file):
    huge = {"path": "huge", "class": "torch.nn.modules.transformer.Transformer", "training": False,
            "kwargs": {"d_model": 4, "nhead": 1, "num_encoder_layers": 20000, "num_decoder_layers": 20000,
                       "dim_feedforward": 4}}
    path = rewrite(good_file, _add_module(huge))
    assert path.stat().st_size < 10_000
    with pytest.raises(SerializationError, match="builds a bigger module than the 0 tensors the file gives "
                                                 "it \\(stopped after 64 tensor operations\\)"):
        load(path)


def test_budget_grows_with_the_tensors_the_file_supplies(good_file):
    """An LSTM with 200 layers listing only the 4 tensors of one layer is stopped, at the budget
    those 4 tensors allow."""
    lstm = {"path": "rnn", "class": "torch.nn.modules.rnn.LSTM", "training": False,
            "kwargs": {"input_size": 4, "hidden_size": 4, "num_layers": 200},
            "params": [[f"{n}_l0", f"fc.module.{n}"] for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]}
    path = rewrite(good_file, _add_module(lstm))
    budget = 64 + WORK_PER_TENSOR * 4
    with pytest.raises(SerializationError, match=f"stopped after {budget} tensor operations"):
        load(path)


def test_huge_sizes_on_the_meta_device_fail_on_shape_not_memory(good_file):
    """A layer asking for a 10^12-element weight is built on the meta device (no memory) and refused
    because its shape does not fit the file's tensor."""
    path = rewrite(good_file, lambda d, t: module(d, "fc.module")["kwargs"].update(
        in_features=1_000_000, out_features=1_000_000))
    with pytest.raises(SerializationError, match="expects \\(1000000, 1000000\\)"):
        load(path)


SWAP_AFTER_CHECK = """
import os, sys
from pathlib import Path
from qplug_core.serialization import files, load

path = Path(sys.argv[1])
checked = files._check_head

def swap_then_check(*args):  # the attacker wins the race: the checked path is now a FIFO
    path.unlink()
    os.mkfifo(path)
    return checked(*args)

files._check_head = swap_then_check
load(path)
print("loaded")
"""


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX only")
def test_a_path_swapped_after_the_check_is_never_opened_again(good_file, tmp_path):
    """TOCTOU (issue 27, finding 8): the file is checked, then the path is replaced by a FIFO.
    Before, safetensors opened the path again and blocked on the FIFO (holding the GIL, so in a
    process of its own here); now the model is read from the descriptor that was checked."""
    path = tmp_path / "model.safetensors"
    path.write_bytes(good_file.read_bytes())
    try:
        result = subprocess.run([sys.executable, "-c", SWAP_AFTER_CHECK, str(path)],
                                capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("qp.load opened the swapped path again and blocked on the FIFO")
    assert result.returncode == 0 and result.stdout == "loaded\n", result.stderr[-2000:]
