"""Defects an engineer deploying quantized models found (2026-12-06): each test is the deployer's
own call, with the numbers or the error a server relies on."""

from __future__ import annotations

import copy
import os
import stat

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import InputMismatchError, ModelStateError
from qplug_core.zoo.digits import load_digits_tensors, train_digits_cnn

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


@pytest.fixture(scope="module")
def digits():
    model, _ = train_digits_cnn()
    _, _, x_test, _ = load_digits_tensors()
    return model.eval(), x_test


@pytest.mark.parametrize("backend, other_engine", [("fbgemm", "qnnpack"), ("qnnpack", "x86")])
def test_a_deep_copy_answers_as_the_model_whatever_engine_is_global(digits, backend, other_engine):
    """deepcopy repacked the weights under the global engine (torch's default 'x86') while the copy
    still said engine='fbgemm': 66 of 4,500 outputs a step away on qnnpack. Per-worker copies
    and A/B setups deep-copy models."""
    model, x = digits
    int8 = qp.quantize(model, (x[:8],), [(x[i:i + 64],) for i in range(0, 256, 64)], backend=backend)
    expected = int8(x)
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = other_engine
    try:
        clone = copy.deepcopy(int8)
        engines = []  # the engine the copy's ops run under, whatever the CPU makes of a wrong one
        last = list(clone.children())[-1]
        last.register_forward_hook(lambda *_: engines.append(torch.backends.quantized.engine))
        answer = clone(x)
    finally:
        torch.backends.quantized.engine = previous
    assert torch.equal(answer, expected)
    assert engines == [backend]  # torch.fx's deepcopy kept no forward hook: the engine pin was lost
    with pytest.raises(InputMismatchError):  # nor the input checks
        clone(x.double())


@pytest.mark.parametrize("backend", ["qnnpack", "fbgemm"])
@pytest.mark.parametrize("shape, says", [((4, 1, 16, 16), r"int8 Linear takes inputs with 512 features"),
                                         ((4, 3, 8, 8), r"int8 Conv2d takes inputs with 1 channel \(dimension 1\)")])
def test_a_wrongly_shaped_input_is_refused_not_answered(digits, backend, shape, says):
    """qnnpack answered 16x16 or 3-channel images sent to the 8x8 digits CNN with plausible logits
    (its linear read 2,048 features against a 512-wide weight); fbgemm said "The number of rows in
    the packB should be equal to K". The float model raises on both."""
    model, x = digits
    int8 = qp.quantize(model, (x[:8],), [(x[i:i + 64],) for i in range(0, 256, 64)], backend=backend)
    with pytest.raises(InputMismatchError, match=says):
        int8(torch.rand(shape))


def test_a_saved_file_keeps_the_permissions_a_new_or_replaced_file_would_have(tmp_path):
    """safetensors writes 0600, and the atomic replace took that mode over an existing 0644 file:
    a model saved by a CI job could not be read by a server running as another user."""
    int8 = qp.quantize_dynamic(nn.Sequential(nn.Linear(8, 8)).eval(), backend="fbgemm")
    previous = os.umask(0o022)
    try:
        fresh = qp.save(int8, tmp_path / "fresh.safetensors")
        assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o644
        kept = tmp_path / "kept.safetensors"
        kept.write_bytes(b"")
        os.chmod(kept, 0o640)
        qp.save(int8, kept)
        assert stat.S_IMODE(os.stat(kept).st_mode) == 0o640
    finally:
        os.umask(previous)


def test_a_loaded_model_first_called_on_an_empty_batch_answers_empty(digits, tmp_path):
    """A server flushing an empty queue right after start-up got BackendError from openvino (which
    refuses to compile size 0): the same model answers (0, 10) once it has seen any batch."""
    model, x = digits
    int8 = qp.quantize(model, (x[:8],), [(x[i:i + 64],) for i in range(0, 256, 64)], backend="openvino")
    loaded = qp.load(qp.save(int8, tmp_path / "m.safetensors"))
    assert loaded(x[:0]).shape == (0, 10)
    assert torch.equal(loaded(x[:16]), int8(x[:16]))


def test_torch_jit_trace_refuses_what_runs_outside_pytorch_and_records_what_does_not(digits):
    """A traced onnxruntime model answered every input with its output for the trace's example
    (SQNR -1.7 dB on a new input): ONNX Runtime takes numpy arrays, which the tracer records as a
    constant. fbgemm's kernels are torch ops and trace."""
    model, x = digits
    calibration = [(x[i:i + 64],) for i in range(0, 256, 64)]
    with pytest.raises(ModelStateError, match=r"torch.jit.trace cannot record a partition compiled by "
                                              r"OrtPartition: it computes outside PyTorch"):
        torch.jit.trace(qp.quantize(model, (x[:8],), calibration, backend="onnxruntime"), (x[:8],))
    linear = nn.Sequential(nn.Linear(64, 64)).eval()
    weight_only = qp.quantize_weights(linear, bits=8, kernel="onnxruntime-matmulnbits")
    with pytest.raises(ModelStateError, match=r"weight-only kernel onnxruntime-matmulnbits"):
        torch.jit.trace(weight_only, (torch.randn(2, 64),))
    fbgemm = qp.quantize(model, (x[:8],), calibration, backend="fbgemm")
    traced = torch.jit.trace(fbgemm, (x[:8],))
    assert torch.equal(traced(x[100:140]), fbgemm(x[100:140]))


@pytest.mark.parametrize("backend", ["fbgemm", "onnxruntime", "openvino"])
def test_torch_compile_runs_the_int8_model_as_it_runs_eager(digits, backend):
    """torch.compile of a model whose one partition runs in ONNX Runtime or OpenVINO raised
    "'SolePartitionForward' object has no attribute '__code__'" (dynamo reads gm.forward.__code__)."""
    model, x = digits
    int8 = qp.quantize(model, (x[:8],), [(x[i:i + 64],) for i in range(0, 256, 64)], backend=backend)
    compiled = torch.compile(int8)
    for batch in (x[100:108], x[200:203]):
        assert torch.equal(compiled(batch), int8(batch))


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_a_compiled_partition_given_a_wrong_shape_names_the_input(digits, backend, tmp_path):
    """onnxruntime and openvino compile a partition per new input shape, and a shape the layers
    cannot take raised torch's "mat1 and mat2 shapes cannot be multiplied" (converted) or a
    BackendError blaming the compile (loaded)."""
    model, x = digits
    int8 = qp.quantize(model, (x[:8],), [(x[i:i + 64],) for i in range(0, 256, 64)], backend=backend)
    loaded = qp.load(qp.save(int8, tmp_path / "m.safetensors"))
    for served in (int8, loaded):
        with pytest.raises(InputMismatchError, match=r"cannot take inputs of shape \(4, 1, 16, 16\): the "
                                                     "model's inputs do not have the shape"):
            served(torch.rand(4, 1, 16, 16))
