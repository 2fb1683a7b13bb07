"""What the commands read from the user: a model factory (``MODULE:FACTORY``) and calibration
tensors. Every failure becomes one :class:`QplugError` line; files are read without unpickling."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from qplug_core.cli._common import example_tensor, warn
from qplug_core.errors import CalibrationError, ConfigError, did_you_mean

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


#: ``--example-dtype`` names -> torch dtypes (inputs are float unless told otherwise)
INPUT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "bool": torch.bool}


@dataclass(frozen=True)
class InputSpec:
    """One positional input of the model's forward: its example shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point

    def example(self) -> torch.Tensor:
        """A deterministic example: normal noise for float inputs, ones for integer ones."""
        return example_tensor(self.shape, torch.Generator().manual_seed(0), self.dtype)


def input_specs(shapes: list[str], dtypes: list[str]) -> list[InputSpec]:
    """Pair each ``--example-shape`` with its ``--example-dtype`` (one dtype applies to all)."""
    from qplug_core.cli._common import UsageError, parse_shape

    if len(dtypes) not in (0, 1, len(shapes)):
        raise UsageError(f"{len(shapes)} --example-shape but {len(dtypes)} --example-dtype "
                          "options: give one --example-dtype per input, or one for all",
                          field="--example-dtype", value=dtypes)
    names = dtypes * len(shapes) if len(dtypes) == 1 else dtypes or ["float32"] * len(shapes)
    for name in names:
        if name not in INPUT_DTYPES:
            raise UsageError(f"--example-dtype {name!r} is not one of {', '.join(INPUT_DTYPES)}"
                              f"{did_you_mean(name, list(INPUT_DTYPES))}",
                              field="--example-dtype", value=name)
    return [InputSpec(parse_shape(shape), INPUT_DTYPES[name]) for shape, name in zip(shapes, names)]


def forward_input_names(model: nn.Module, count: int) -> list[str]:
    """The names of the first ``count`` positional parameters of ``model.forward``."""
    params = [p.name for p in inspect.signature(model.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return params[:count]


#: the ``what`` of held-out inputs: other sizes than the example's are the point of them (sequence
#: lengths of held-out sentences); the model itself says if it cannot take one
EVAL = "--eval"


def load_batches(path: Path, specs: list[InputSpec] | None, names: list[str], *,
                 what: str = "calibration") -> list[tuple]:
    """Batches of positional inputs from a ``.safetensors`` or ``.npy`` file.

    A file for a one-input model holds one tensor per batch (any keys, taken in natural order: 2
    before 10). For several inputs its keys are ``NAME/INDEX`` (``input_ids/0``,
    ``attention_mask/0``, ...), NAME being a parameter of ``forward``. A ``.npy`` file is one
    batch of a one-input model. Nothing is unpickled. With ``specs`` (the example inputs) every
    tensor is checked against its input's dtype and shape (``--eval`` tensors: its rank only).
    """
    tensors = _read_tensors(path, what)
    if len(names) == 1 and not any("/" in key for key in tensors):
        batches = [(tensors[key],) for key in sorted(tensors, key=_natural)]
    else:
        batches = _named_batches(path, tensors, names)
    if specs is None:
        return batches
    return [tuple(_checked(path, what, key, tensor, spec) for tensor, spec, key in
                  zip(batch, specs, names)) for batch in batches]


def input_count(path: Path) -> int:
    """How many inputs a batch in ``path`` holds (the distinct NAMEs of NAME/INDEX keys, or 1)."""
    names = {key.rpartition("/")[0] for key in _read_tensors(path, "input") if "/" in key}
    return len(names) or 1


def _natural(key: str) -> tuple:
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key))


def _read_tensors(path: Path, what: str) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CalibrationError(f"{what} file {path} does not exist")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(path))
        except Exception as exc:  # safetensors reports malformed files as plain exceptions
            raise CalibrationError(f"cannot read {what} file {path}: {exc}") from exc
    elif path.suffix == ".npy":
        import numpy as np

        try:
            array = np.load(path, allow_pickle=False)
        except Exception as exc:  # pickled object arrays raise ValueError, bad files OSError
            raise CalibrationError(f"cannot read {what} file {path} (a plain numeric .npy "
                                   f"array is needed; pickles are refused): {exc}") from exc
        tensors = {"array": torch.from_numpy(array)}
    else:
        raise CalibrationError(f"{what} file {path} must end in .safetensors (tensors keyed by "
                               "batch, or NAME/INDEX for several inputs) or .npy (one batch)")
    if not tensors:
        raise CalibrationError(f"{what} file {path} holds no tensors")
    return tensors


def _named_batches(path: Path, tensors: dict[str, torch.Tensor], names: list[str]) -> list[tuple]:
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name, sep, index = key.rpartition("/")
        if not sep or name not in names:
            raise CalibrationError(
                f"tensor {key!r} in {path}: keys must be NAME/INDEX with NAME one of the model's "
                f"inputs ({', '.join(names)}){did_you_mean(name or key, names)}")
        grouped.setdefault(index, {})[name] = tensor
    batches = []
    for index in sorted(grouped, key=_natural):
        missing = [name for name in names if name not in grouped[index]]
        if missing:
            raise CalibrationError(f"batch {index!r} in {path} has no {', '.join(missing)}: "
                                   f"each batch needs every input ({', '.join(names)})")
        batches.append(tuple(grouped[index][name] for name in names))
    return batches


def _checked(path: Path, what: str, name: str, tensor: torch.Tensor, spec: InputSpec
             ) -> torch.Tensor:
    if tensor.is_floating_point() != spec.is_float:
        kind = "floating point" if spec.is_float else "integer"
        raise CalibrationError(
            f"{what} tensor {name!r} in {path} is {tensor.dtype} but the input is {spec.dtype} "
            f"(--example-dtype): {what} tensors for it must be {kind}")
    if tensor.dim() != len(spec.shape):
        raise CalibrationError(
            f"{what} tensor {name!r} in {path} has shape {tuple(tensor.shape)} but --example-shape is "
            f"{','.join(map(str, spec.shape))}: it must have {len(spec.shape)} dimensions")
    if what != EVAL and tuple(tensor.shape[1:]) != spec.shape[1:]:
        raise CalibrationError(
            f"{what} tensor {name!r} in {path} has shape {tuple(tensor.shape)} but --example-shape is "
            f"{','.join(map(str, spec.shape))}; all sizes but the first (batch) must match")
    return tensor.to(spec.dtype)


def random_calibration(specs: list[InputSpec]) -> list[tuple]:
    """Standard-normal batches, with a loud warning: int8 ranges fitted to noise, not real data.

    Integer inputs (token ids, masks) have no meaningful random stand-in, so they need a file.
    """
    if not all(spec.is_float for spec in specs):
        dtypes = ", ".join(str(spec.dtype).removeprefix("torch.") for spec in specs)
        raise CalibrationError(f"--example-dtype gives the model integer inputs ({dtypes}): pass "
                               "--calibration FILE with real inputs (random token ids would not "
                               "calibrate anything), or leave out --example-dtype for float inputs")
    shapes = " ".join(",".join(map(str, spec.shape)) for spec in specs)
    warn(f"no --calibration file: calibrating on {RANDOM_BATCHES} batches of random normal data of "
         f"shape {shapes}; int8 ranges will not fit real inputs and accuracy may suffer. Pass "
         "--calibration FILE (.safetensors or .npy) with representative inputs.")
    generator = torch.Generator().manual_seed(0)
    return [tuple(example_tensor(spec.shape, generator, spec.dtype) for spec in specs)
            for _ in range(RANDOM_BATCHES)]
