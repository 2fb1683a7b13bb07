"""Float outputs on a backend that fuses a weighted op's dequantization (``float_outputs``:
qplug-openvino for every weighted op, qplug-onnxruntime for linears): the plan, its accuracy, the
compiled kernels, and a reference form made for another backend (``backend="auto"``'s base)
finished on it."""

from __future__ import annotations

import os
import warnings

import onnx
import pytest
import torch

import qplug_core as qp
from qplug_core.plugin_api import BackendSpec, ConfigValidationError, override_cpu_flags


def partitions(model) -> list:
    return [m for m in model.modules() if type(m).__name__ in ("OpenVinoPartition", "OrtPartition")]


class _Residual(torch.nn.Module):
    """A two-linear block on a residual stream whose second linear writes one massive channel (a
    trained transformer's FFN output): no int8 op reads that output, only the float add."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)
        with torch.no_grad():
            self.fc2.bias[0] = 200.0

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


def _quantized_after(reference: torch.nn.Module, name: str) -> bool:
    (node,) = [n for n in reference.graph.nodes if n.op == "call_module" and n.target == name]
    return any(u.op == "call_module" and type(reference.get_submodule(u.target)).__name__ == "Quantize"
               for u in node.users)


def test_an_output_no_int8_op_reads_stays_float(plugin_autoload):
    torch.manual_seed(0)
    model = _Residual().eval()
    data = [(torch.randn(16, 32, generator=torch.Generator().manual_seed(s)),) for s in range(3)]
    x = (torch.randn(16, 32, generator=torch.Generator().manual_seed(9)),)
    outputs = {}
    for backend in ("openvino", "fbgemm"):
        observed = qp.prepare_fx(model, qp.get_default_qconfig_mapping(backend), data[0], backend=backend)
        reference = qp.convert_to_reference_fx(qp.calibrate(observed, data))
        # fc1's output feeds fc2 (int8 either way); fc2's feeds only the float residual add
        assert _quantized_after(reference, "fc1")
        assert _quantized_after(reference, "fc2") == (backend == "fbgemm")
        with torch.no_grad():
            outputs[backend] = reference(*x)
    with torch.no_grad():
        expected = model(*x)
    # a per-tensor grid on fc2's output spends its levels on the massive channel
    assert qp.sqnr(expected, outputs["openvino"]) > qp.sqnr(expected, outputs["fbgemm"]) + 10.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qmodel = qp.quantize(model, data[0], data, backend="openvino")
    report = qp.quantization_report(qmodel)
    assert not report.reference and {"fc1", "fc2"} <= set(report.kernels)
    (partition,) = partitions(qmodel)
    runtime = partition.compiled_models[0].get_runtime_model()
    precisions = [op.get_rt_info()["runtimePrecision"].astype(str) for op in runtime.get_ops()
                  if op.get_rt_info()["layerType"].astype(str) == "FullyConnected"]
    assert precisions == ["u8", "u8"]  # both int8: the dequantization is fused into fc2
    with torch.no_grad():
        torch.testing.assert_close(qmodel(*x), partition.partition(*x), rtol=0, atol=0.05)


def test_onnxruntime_keeps_float_the_linear_outputs_no_int8_op_reads(plugin_autoload):
    # ORT fuses a dequantized matmul with no QuantizeLinear after it into one int8 op with a
    # float output: fc2's output (read by the float residual add alone) needs no grid there
    torch.manual_seed(0)
    model = _Residual().eval()
    data = [(torch.randn(16, 32, generator=torch.Generator().manual_seed(s)),) for s in range(3)]
    x = (torch.randn(16, 32, generator=torch.Generator().manual_seed(9)),)
    mapping = qp.get_default_qconfig_mapping("onnxruntime")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        on_ort = qp.quantize(model, data[0], data, backend="onnxruntime")
        every_grid = qp.quantize(model, data[0], data, backend="fbgemm", qconfig_mapping=mapping)
    (partition,) = partitions(on_ort)
    assert _quantized_after(partition.partition, "fc1") and not _quantized_after(partition.partition, "fc2")
    with torch.no_grad():
        expected = model(*x)
        # measured 77.0 dB against 44.6 dB with fc2's output on a per-tensor grid (fbgemm)
        assert qp.sqnr(expected, on_ort(*x)) > qp.sqnr(expected, every_grid(*x)) + 20.0
    optimized = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"qplug-float-outputs-{os.getpid()}.onnx")
    try:
        partition.session_settings.inference_session(partition.sources[0], optimized_model_filepath=optimized)
        ops = [node.op_type for node in onnx.load(optimized).graph.node]
    finally:
        os.remove(optimized)
    # both linears int8 (the second writes float): no QuantizeLinear -> DequantizeLinear between
    assert ops == ["QuantizeLinear", "QGemm", "QGemm", "Add"]


class _TwoHeads(torch.nn.Module):
    """A conv head and a linear head, each writing a model output (no int8 op reads either)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(8, 4, 3, padding=1)
        self.fc1, self.fc2 = torch.nn.Linear(48, 32), torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.conv2(torch.relu(self.conv1(x))), self.fc2(torch.relu(self.fc1(x.flatten(1))))


@pytest.mark.parametrize("backend, float_after", [("onnxruntime", {"fc2"}), ("openvino", {"fc2", "conv2"})])
def test_only_the_declared_kinds_keep_float_outputs(plugin_autoload, backend, float_after):
    # ORT has no int8 conv with a float output (a conv without QuantizeLinear after it runs in
    # float), so its convs keep their grids; openvino's keep none
    torch.manual_seed(0)
    model = _TwoHeads().eval()
    data = [(torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(s)),) for s in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qmodel = qp.quantize(model, data[0], data, backend=backend)
    (partition,) = partitions(qmodel)
    assert {name for name in ("conv2", "fc2") if not _quantized_after(partition.partition, name)} == float_after


def test_float_outputs_declares_every_kind_or_a_set_of_them():
    assert BackendSpec("a", "", float_outputs=True).float_outputs == {"linear", "conv"}
    assert BackendSpec("a", "", float_outputs={"linear"}).float_outputs == frozenset({"linear"})
    assert BackendSpec("a", "").float_outputs == frozenset()
    for bad in ({"matmul"}, "linear"):
        with pytest.raises(ConfigValidationError, match="float_outputs must be True, False or a set"):
            BackendSpec("a", "", float_outputs=bad)


@pytest.mark.parametrize("backend", ["openvino", "onnxruntime"])
def test_a_reference_form_made_for_another_backend_drops_the_grids_its_backend_needs_not(plugin_autoload, backend):
    # backend="auto" calibrates once on a backend that quantizes every weighted output, then
    # finishes that reference form on the others: it must be the model their own prepare gives
    from qplug_core.flows.auto import finish_on
    from qplug_core.flows.snapshot import snapshot_of

    torch.manual_seed(0)
    model = _Residual().eval()
    data = [(torch.randn(16, 32, generator=torch.Generator().manual_seed(s)),) for s in range(3)]
    mapping = qp.get_default_qconfig_mapping("onnxruntime")
    with override_cpu_flags("avx2 avx512f avx512bw avx512_vnni"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        on_fbgemm = qp.quantize(model, data[0], data, backend="fbgemm", qconfig_mapping=mapping)
        finished = finish_on(snapshot_of(on_fbgemm), qp.get_backend(backend), on_fbgemm)
        own = qp.quantize(model, data[0], data, backend=backend, qconfig_mapping=mapping)
    (finished_partition,), (own_partition,) = partitions(finished), partitions(own)
    assert not _quantized_after(finished_partition.partition, "fc2")
    x = (torch.randn(16, 32, generator=torch.Generator().manual_seed(9)),)
    with torch.no_grad():
        assert torch.equal(finished_partition.partition(*x), own_partition.partition(*x))
        assert torch.equal(finished(*x), own(*x))


def test_auto_gives_float_output_backends_their_own_base_where_a_target_decides(plugin_autoload):
    # a target measures each layer with the grids its backend keeps: openvino's decisions are
    # its own, and so are onnxruntime's (float outputs for linears only: a third kind); without
    # a target one calibration serves every candidate
    torch.manual_seed(0)
    model = _Residual().eval()
    data = [(torch.randn(16, 32, generator=torch.Generator().manual_seed(s)),) for s in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        targeted = qp.quantize(model, data[0], data, backend="auto", target=qp.Target(cosine=0.999))
        plain = qp.quantize(model, data[0], data, backend="auto", recipe="none")
    bases = {t["backend"] for t in qp.quantization_report(targeted).auto if t["base"]}
    assert {"openvino", "onnxruntime"} < bases and len(bases) == 3
    (base,) = [t["backend"] for t in qp.quantization_report(plain).auto if t["base"]]
    assert base not in ("openvino", "onnxruntime")
    x = (torch.randn(16, 32, generator=torch.Generator().manual_seed(9)),)
    if qp.quantization_report(targeted).backend == "openvino":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            own = qp.quantize(model, data[0], data, backend="openvino", target=qp.Target(cosine=0.999))
        with torch.no_grad():
            assert torch.equal(targeted(*x), own(*x))


def test_auto_with_the_users_mapping_calibrates_on_a_backend_that_keeps_every_grid(plugin_autoload, monkeypatch):
    from qplug_core.flows import auto

    listed = auto.candidates
    monkeypatch.setattr(auto, "candidates", lambda: (  # openvino first, as another install may list it
        sorted(listed()[0], key=lambda b: b.name != "openvino"), listed()[1]))
    torch.manual_seed(0)
    model = _Residual().eval()
    data = [(torch.randn(16, 32, generator=torch.Generator().manual_seed(s)),) for s in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qmodel = qp.quantize(model, data[0], data, backend="auto", recipe="none",
                             qconfig_mapping=qp.get_default_qconfig_mapping("onnxruntime"))
    (base,) = [t["backend"] for t in qp.quantization_report(qmodel).auto if t["base"]]
    assert base not in ("openvino", "onnxruntime")


class _Bag(torch.nn.Module):
    """A recommendation model's shape: an EmbeddingBag (8-bit rows) beside dense features, an MLP head
    writing one score a sample (no int8 op reads it)."""

    def __init__(self):
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(1000, 8, mode="sum")
        self.mlp = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def forward(self, ids, offsets, dense):
        return self.mlp(torch.cat([self.bag(ids, offsets), dense], 1))


def _bags(batch: int, seed: int) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 6, (batch,), generator=generator)
    ids = torch.randint(0, 1000, (int(lengths.sum()),), generator=generator)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    return ids, offsets, torch.randn(batch, 4, generator=generator)


@pytest.mark.slow  # one ONNX export: 6 s on the loaded 2-core CI box
def test_onnxruntime_bag_model_is_the_reference_form_with_its_float_output_and_says_so(plugin_autoload):
    # field report s29 F6: ORT's output differed from backend="reference"'s by about the int8
    # error itself (fbgemm's: none); the whole difference is the head's output grid, which ORT
    # leaves float: its partition (the 8-bit bag rows exported as Int8Table, the MLP as QDQ) is
    # the reference form without that grid, and the report names the layer
    from qplug_core.flows.float_outputs import drop_unread_output_grids

    torch.manual_seed(0)
    model = _Bag().eval()
    data = [_bags(16, seed) for seed in range(4)]
    mapping = qp.get_default_qconfig_mapping("onnxruntime")  # the same qparams on both
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        on_ort = qp.quantize(model, data[0], data, backend="onnxruntime", recipe="none")
        reference = qp.quantize(model, data[0], data, backend="reference", recipe="none", qconfig_mapping=mapping)
    assert qp.quantization_report(on_ort).float_outputs == ["mlp.2"]
    assert "float outputs: 1 int8 layer(s)" in str(qp.quantization_report(on_ort))
    assert qp.quantization_report(reference).float_outputs == []
    assert drop_unread_output_grids(reference, frozenset({"linear"})) == 1
    held = _bags(64, 9)
    (partition,) = partitions(on_ort)
    with torch.no_grad():
        got, expected, own = on_ort(*held), reference(*held), partition.partition(*held)
    step = float(expected.max() - expected.min()) / 255  # the contract's step for a float output
    assert torch.equal(own, expected)  # measured: identical; ORT within 0.3 of a step of it
    assert (got - expected).abs().max() <= step
