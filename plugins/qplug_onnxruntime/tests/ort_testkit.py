"""Shared helpers: quantize a zoo model for onnxruntime and its reference form from one calibration."""

from __future__ import annotations

import copy
import warnings

import torch

import qplug_core as qp

IMAGE_MODELS = ("resnet18", "resnet50", "mobilenet_v2")


def inputs(name: str, seed: int, batch: int = 1) -> tuple[torch.Tensor, ...]:
    if name in IMAGE_MODELS:
        return (torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed)),)
    return qp.zoo.example_inputs(name, batch=batch, seed=seed)


def quantized_pair(name: str, *, batches: int = 2):
    """(float model, onnxruntime model, reference model) from one prepared and calibrated model."""
    model = qp.zoo.get_model(name, seed=0)
    calibration = [inputs(name, seed) for seed in range(batches)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        observed = qp.prepare_fx(model, None, calibration[0], backend="onnxruntime")
        qp.calibrate(observed, calibration)
        reference = qp.convert_to_reference_fx(copy.deepcopy(observed))
        ort_model = qp.convert_fx(observed)
    return model, ort_model, reference


def output_step(reference) -> float:
    """One quantization step of the output: the scale of the last dequantize before it."""
    scale = None
    for node in reference.graph.nodes:
        if node.op == "call_module" and type(reference.get_submodule(node.target)).__name__ == "Dequantize":
            scale = float(reference.get_submodule(node.target).scale.max())
    assert scale is not None, "the model has no int8 value"
    return scale


def within_one_step(a: torch.Tensor, b: torch.Tensor, step: float) -> float:
    """Fraction of elements of ``a`` and ``b`` that differ by at most one step."""
    return float(((a - b).abs() <= step * 1.001).float().mean())
