"""Shared helpers: a zoo model quantized for openvino and its reference form, from one calibration."""

from __future__ import annotations

import copy
import functools
import warnings

import torch

import qplug_core as qp

IMAGE_MODELS = ("resnet18", "resnet50", "mobilenet_v2")


def inputs(name: str, seed: int, batch: int = 1) -> tuple[torch.Tensor, ...]:
    if name in IMAGE_MODELS:
        return (torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed)),)
    return qp.zoo.example_inputs(name, batch=batch, seed=seed)


@functools.lru_cache(maxsize=None)  # the tests of a module share one quantized model per name
def quantized_pair(name: str):
    """(float model, openvino model, reference model) from one prepared and calibrated model."""
    model = qp.zoo.get_model(name, seed=0)
    calibration = [inputs(name, seed) for seed in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        observed = qp.prepare_fx(model, None, calibration[0], backend="openvino")
        qp.calibrate(observed, calibration)
        reference = qp.convert_to_reference_fx(copy.deepcopy(observed))
        ov_model = qp.convert_fx(observed)
    return model, ov_model, reference


def output_step(expected: torch.Tensor) -> float:
    """The kernel contract's step of a float output (the digits CNN's classifier writes its logits
    in float on openvino: no int8 op reads them): its range / 255."""
    return float(expected.max() - expected.min()) / 255
