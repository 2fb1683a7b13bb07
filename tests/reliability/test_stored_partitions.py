"""A delegated model's file stores its partitions' ONNX models; ``qp.load`` builds from them, checked.

The first call of a loaded onnxruntime/openvino model exported each partition again (7.0 s and
14.4 s for the digits CNN). Now it builds the runtime's models from the ONNX models ``qp.save``
stored, without the exporter; a stored model that is not what qplug's exporter writes for that
partition (docs/security.md) is not built: a warning says so at load and the partition is
exported from the reference form as before. Files without stored models load as they did.
"""

from __future__ import annotations

import json
import warnings

import onnx
import pytest
import torch
from artifactkit import rewrite

import qplug_core as qp

pytestmark = [pytest.mark.usefixtures("one_thread", "plugin_autoload"), pytest.mark.slow]  # ~25 s: two converts

KEY = "partition_models/delegate_0/0"


def _images(seed: int, batch: int) -> tuple[torch.Tensor]:
    return qp.zoo.example_inputs("digits_cnn", batch=batch, seed=seed)


@pytest.fixture(scope="module", params=["onnxruntime", "openvino"])
def saved(request, tmp_path_factory):
    """(model, its file): converted on batch 2 (a model serving every batch >= 2), called on
    batch 1 too (a model for it), so the file stores both."""
    pytest.importorskip(f"qplug_{request.param}")
    with qp.testing.all_plugins_loaded(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calibration = [_images(seed, 2) for seed in range(2)]
        model = qp.quantize(qp.zoo.get_model("digits_cnn", seed=0), calibration[0], calibration,
                            backend=request.param)
        with torch.no_grad():
            model(*_images(0, 1))
        path = qp.save(model, tmp_path_factory.mktemp(request.param) / "digits.safetensors")
    return model, path


@pytest.fixture
def no_export(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("torch.onnx.export was called")

    monkeypatch.setattr(torch.onnx, "export", refuse)


def test_a_loaded_model_answers_as_the_saved_one_without_exporting(saved, no_export):
    model, path = saved
    loaded = qp.load(path)
    with torch.no_grad():
        for batch in (1, 4, 7):
            x = _images(10 + batch, batch)
            assert torch.equal(loaded(*x), model(*x)), batch


def _edited(edit):
    """An edit of the stored model's bytes, for ``artifactkit.rewrite``."""
    def rewritten(document, tensors):
        source = edit(tensors[KEY].numpy().tobytes())
        tensors[KEY] = torch.frombuffer(bytearray(source), dtype=torch.uint8)
        document["model"]["tensors"][KEY]["shape"] = [len(source)]
    return rewritten


def _proto_edit(change):
    def edit(source: bytes) -> bytes:
        model = onnx.load_model_from_string(source)
        change(model)
        return model.SerializeToString()
    return edit


def _custom_domain(model) -> None:
    model.opset_import.append(onnx.helper.make_opsetid("evil.ops", 1))
    model.graph.node[0].domain = "evil.ops"


def _extra_input(model) -> None:
    model.graph.input.append(onnx.helper.make_tensor_value_info("extra", onnx.TensorProto.FLOAT, [1]))


def _external_weights(model) -> None:
    tensor = model.graph.initializer[0]
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value="secrets.bin")


TAMPERED = {
    "garbage": (lambda source: b"\x08\x07garbage" * 64, r"it is not a valid ONNX model \(DecodeError: "),
    "custom domain": (_proto_edit(_custom_domain), r"it names op domains qplug's exporter does not write \(evil.ops\)"),
    "input count": (_proto_edit(_extra_input), r"it has 2 input\(s\) and 1 output\(s\) where the partition has 1 and 1"),
    "external data": (_proto_edit(_external_weights), "it reads tensors from external files"),
}


@pytest.mark.parametrize("case", TAMPERED)
def test_a_tampered_stored_model_is_not_built_and_a_warning_says_so(saved, case):
    edit, problem = TAMPERED[case]
    tampered = rewrite(saved[1], _edited(edit))
    with pytest.warns(UserWarning, match=f"stores for partition delegate_0 is not used: {problem}.*; the partition "
                                         "is exported again from its reference form"):
        qp.load(tampered)


def test_a_tampered_model_is_exported_again_and_answers_as_the_saved_one(saved):
    model, path = saved
    with pytest.warns(UserWarning, match="is not used"):
        loaded = qp.load(rewrite(path, _edited(_proto_edit(_custom_domain))))
    x = _images(3, 4)
    with torch.no_grad():
        assert torch.equal(loaded(*x), model(*x))


def _negated_weights(model) -> None:
    """Every int8 weight the model holds itself negated (the first conv's: the others' bytes are
    the reference form's): a model that still passes every check at load and computes wrong."""
    for tensor in model.graph.initializer:
        if tensor.data_type == onnx.TensorProto.INT8 and tensor.raw_data:
            negated = -onnx.numpy_helper.to_array(tensor).clip(-127, 127)
            tensor.CopyFrom(onnx.numpy_helper.from_array(negated, tensor.name))


@pytest.mark.parametrize("runtime", ["as saved", "another version", "not recorded"])
def test_a_stored_model_is_checked_at_its_first_call_where_the_runtime_version_differs(saved, runtime):
    """The stored model is the one convert checked, by the runtime that compiled it then: a first
    call on another version of that runtime (recorded as ``runtime`` beside the models) is held to
    the contract again; a file recording none (written before) is trusted as before, as is one
    whose recorded version is this one (docs/security.md). Weights edited to be wrong show which."""
    model, path = saved

    def edit(document, tensors) -> None:
        _edited(_proto_edit(_negated_weights))(document, tensors)
        entry = document["model"]["partition_models"]["delegate_0"]
        if runtime == "another version":
            entry["runtime"]["version"] += "-older"
        elif runtime == "not recorded":
            del entry["runtime"]

    loaded, x = qp.load(rewrite(path, edit)), _images(6, 4)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        error = (loaded(*x) - model(*x)).norm() / model(*x).norm()
    checked = [str(w.message) for w in caught if "on its first inputs after qp.load" in str(w.message)]
    if runtime == "another version":  # its reference form answers: within the int8 noise of the saved model
        assert len(checked) == 1 and "broke the kernel contract" in checked[0] and "reference form kept" in checked[0]
        assert error < 0.1
    else:
        assert not checked and error > 0.5


def test_a_file_without_stored_models_loads_and_exports_as_before(saved):
    model, path = saved

    def older(document, tensors) -> None:
        for key in [k for k in tensors if k.startswith("partition_models/")]:
            del tensors[key], document["model"]["tensors"][key]
        del document["model"]["partition_models"]

    _answers_as_saved_without_a_warning(model, rewrite(path, older), seed=5)


def _answers_as_saved_without_a_warning(model, path, seed: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = qp.load(path)
    x = _images(seed, 4)
    with torch.no_grad():
        assert torch.equal(loaded(*x), model(*x))


def _held_once(saved_path) -> tuple[dict, dict, dict]:
    """(the stored model's initializers by name, its record, the file's tensors)."""
    from safetensors import safe_open

    with safe_open(saved_path, "pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
        document = json.loads(f.metadata()["qplug"])
    (record,) = [m for m in document["model"]["partition_models"]["delegate_0"]["models"] if m["tensor"] == KEY]
    model = onnx.load_model_from_string(tensors[KEY].numpy().tobytes())
    return {i.name: i for i in model.graph.initializer}, record, tensors


def test_the_file_holds_each_weight_once(saved):
    """The stored model's weights were the reference form's int8 tensors again, byte for byte
    (MobileNetV2: 3.4 of its 4.1 MiB ONNX model); each is stored empty, named after that tensor."""
    initializers, record, tensors = _held_once(saved[1])
    shared = record["shared"]
    assert len(shared) >= 3  # conv2, conv3, fc
    for name, key in shared.items():
        assert not initializers[name].raw_data and tensors[key].dtype == torch.int8
    inline = [i for i in initializers.values() if len(i.raw_data) >= 1024]
    assert not [i.name for i in inline if any(t.numpy().tobytes() == i.raw_data for t in tensors.values())]


def test_a_file_storing_the_weights_inline_loads_without_exporting(saved, no_export):
    """Files written before the weights were held once hold them in the stored model: still built."""
    model, path = saved

    def inline(document, tensors) -> None:
        for record in document["model"]["partition_models"]["delegate_0"]["models"]:
            shared = record.pop("shared")
            source = onnx.load_model_from_string(tensors[record["tensor"]].numpy().tobytes())
            for initializer in source.graph.initializer:
                if initializer.name in shared:
                    initializer.raw_data = tensors[shared[initializer.name]].numpy().tobytes()
            data = source.SerializeToString()
            tensors[record["tensor"]] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            document["model"]["tensors"][record["tensor"]]["shape"] = [len(data)]

    _answers_as_saved_without_a_warning(model, rewrite(path, inline), seed=8)


def test_a_weight_named_after_a_tensor_that_does_not_fit_is_not_built(saved):
    def misnamed(document, tensors) -> None:
        smaller = next(key for key, t in tensors.items() if t.dtype == torch.int8 and t.numel() < 1024)  # conv1's
        for record in document["model"]["partition_models"]["delegate_0"]["models"]:
            record["shared"] = dict.fromkeys(record["shared"], smaller)

    with pytest.warns(UserWarning, match="is not used: initializer .* is not an empty slot for the reference "
                                         "tensor it names"):
        qp.load(rewrite(saved[1], misnamed))


def test_a_file_naming_one_weight_for_many_empty_slots_is_refused_before_they_are_filled(saved):
    """A hostile file: 1000 empty initializers, each named after one of the file's weights (a few
    bytes each in the file, the weight's size each once filled: a 1 MiB file took GBs at load)."""
    def amplified(document, tensors) -> None:
        record = document["model"]["partition_models"]["delegate_0"]["models"][0]
        key = next(iter(record["shared"].values()))
        source = onnx.load_model_from_string(tensors[record["tensor"]].numpy().tobytes())
        for i in range(1000):
            source.graph.initializer.append(onnx.TensorProto(name=f"slot_{i}", data_type=onnx.TensorProto.INT8,
                                                             dims=list(tensors[key].shape)))
            record["shared"][f"slot_{i}"] = key
        data = source.SerializeToString()
        tensors[record["tensor"]] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        document["model"]["tensors"][record["tensor"]]["shape"] = [len(data)]

    with pytest.warns(UserWarning, match="partition delegate_0 is not used: its shared weights fill more "
                                         "initializers than the reference form holds"):
        qp.load(rewrite(saved[1], amplified))


def test_a_file_storing_one_partitions_model_many_times_is_refused_before_they_are_filled(saved):
    """A hostile file: the stored model copied for 100 input signatures of one partition, each filled
    with every shared weight (each copy a few KiB in the file): at most 4x the reference form's
    weights are filled in all, so the partition is exported again, as for other invalid models."""
    def copied(document, tensors) -> None:
        entry = document["model"]["partition_models"]["delegate_0"]
        record = entry["models"][0]
        for i in range(100):
            key = f"partition_models/delegate_0/copy_{i}"
            tensors[key] = tensors[record["tensor"]].clone()
            document["model"]["tensors"][key] = dict(document["model"]["tensors"][record["tensor"]])
            entry["models"].append({**record, "tensor": key})

    with pytest.warns(UserWarning, match=r"partition delegate_0 is not used: its shared weights would fill \d+ bytes "
                                         r"where the file's stored models may fill \d+ more"):
        qp.load(rewrite(saved[1], copied))
