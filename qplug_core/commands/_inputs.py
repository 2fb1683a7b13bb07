"""What the commands read from the user: a model factory (``MODULE:FACTORY``) and calibration
tensors. Every failure becomes one :class:`QplugError` line; files are read without unpickling."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import torch
from torch import nn

from qplug_core.errors import CalibrationError, ConfigError, did_you_mean
from qplug_core.commands._common import example_tensor, warn

#: number of random batches used when no calibration file is given
RANDOM_BATCHES = 4


def load_factory_model(spec: str) -> nn.Module:
    """Import ``MODULE:FACTORY`` (the current directory first on ``sys.path``) and call the factory."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigError(f"{spec!r} is not MODULE:FACTORY; write e.g. mymodels:build_net "
                          "(a function returning a torch.nn.Module)", field="model", value=spec)
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"cannot import {module_name!r}: {exc} (searched the current directory "
                          f"{cwd} and sys.path)", field="model", value=spec) from exc
    except Exception as exc:
        raise ConfigError(f"importing {module_name!r} raised {type(exc).__name__}: {exc}",
                          field="model", value=spec) from exc
    factory = getattr(module, attribute, None)
    if not callable(factory):
        names = [n for n in vars(module) if not n.startswith("_") and callable(vars(module)[n])]
        raise ConfigError(f"module {module_name!r} has no callable {attribute!r}"
                          f"{did_you_mean(attribute, names)}", field="model", value=spec)
    try:
        model = factory()
    except Exception as exc:
        raise ConfigError(f"{spec}() raised {type(exc).__name__}: {exc}", field="model",
                          value=spec) from exc
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{spec}() returned {type(model).__name__}, not a torch.nn.Module",
                          field="model", value=spec)
    return model


def load_calibration(path: Path, example_shape: tuple[int, ...]) -> list[torch.Tensor]:
    """Calibration batches from a ``.safetensors`` file (each tensor one batch, in key order) or a
    ``.npy`` array (one batch); their sizes after the batch dimension must match the example."""
    if not path.is_file():
        raise CalibrationError(f"calibration file {path} does not exist")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(path))
        except Exception as exc:  # safetensors reports malformed files as plain exceptions
            raise CalibrationError(f"cannot read calibration file {path}: {exc}") from exc
        named = sorted(tensors.items())
    elif path.suffix == ".npy":
        import numpy as np

        try:
            array = np.load(path, allow_pickle=False)
        except Exception as exc:  # pickled object arrays raise ValueError, bad files OSError
            raise CalibrationError(f"cannot read calibration file {path} (a plain numeric .npy "
                                   f"array is needed; pickles are refused): {exc}") from exc
        named = [("array", torch.from_numpy(array))]
    else:
        raise CalibrationError(f"calibration file {path} must end in .safetensors (one tensor per "
                               "batch) or .npy (one batch)")
    if not named:
        raise CalibrationError(f"calibration file {path} holds no tensors")
    return [_checked_batch(path, name, tensor, example_shape) for name, tensor in named]


def _checked_batch(path: Path, name: str, tensor: torch.Tensor,
                   example_shape: tuple[int, ...]) -> torch.Tensor:
    if not tensor.is_floating_point():
        raise CalibrationError(f"calibration tensor {name!r} in {path} is {tensor.dtype}; "
                               "calibration batches must be floating point")
    if tuple(tensor.shape[1:]) != example_shape[1:] or tensor.dim() != len(example_shape):
        raise CalibrationError(
            f"calibration tensor {name!r} in {path} has shape {tuple(tensor.shape)} but "
            f"--example-shape is {example_shape}; all sizes but the first (batch) must match")
    return tensor.float()


def random_calibration(example_shape: tuple[int, ...]) -> list[torch.Tensor]:
    """Standard-normal batches, with a loud warning: int8 ranges fitted to noise, not real data."""
    warn(f"no --calibration file: calibrating on {RANDOM_BATCHES} batches of random normal data of "
         f"shape {example_shape}; int8 ranges will not fit real inputs and accuracy may suffer. "
         "Pass --calibration FILE (.safetensors or .npy) with representative inputs.")
    generator = torch.Generator().manual_seed(0)
    return [example_tensor(example_shape, generator) for _ in range(RANDOM_BATCHES)]
