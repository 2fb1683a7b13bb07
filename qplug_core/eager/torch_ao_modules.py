"""torch.ao's eager building blocks in a model being migrated: qplug's own in their place.

A model written for torch.ao holds its ``QuantStub``/``DeQuantStub``, ``FloatFunctional`` and the
fused modules its ``fuse_modules`` made (``torch.ao.nn.intrinsic.ConvReLU2d`` ...). qplug's
classes do the same with the same names and children, so prepare swaps them in (the model's
``forward`` calls them by attribute, unchanged): before, the stubs and functionals met int8
tensors as float modules ("Could not run 'quantized::linear' ...") and the fused modules stayed
float without a word. Any other torch.ao module (its quantized, QAT or quantizable ones) is refused
by name. The classes are recognised by module path and name: runtime code does not import
torch.ao.
"""

from __future__ import annotations

from torch import nn

from qplug_core.eager.functional import FloatFunctional
from qplug_core.eager.stubs import DeQuantStub, QuantStub
from qplug_core.errors import ConfigValidationError
from qplug_core.nn import intrinsic

_TORCH_AO = "torch.ao."
_SAME_ROLE: dict[str, type[nn.Module]] = {"QuantStub": QuantStub, "DeQuantStub": DeQuantStub,
                                          "FloatFunctional": FloatFunctional}
#: torch.ao's containers whose forward only calls their children: kept, their children adopted
_CONTAINERS = ("QuantWrapper",)


def adopt_torch_ao_modules(model: nn.Module) -> None:
    """Swap torch.ao's stubs, functionals and fused modules in ``model`` for qplug's, in place."""
    for name, module in list(model.named_modules()):
        cls = type(module)
        if not cls.__module__.startswith(_TORCH_AO) or cls.__name__ in _CONTAINERS:
            continue
        replacement = _qplug_twin(module, name)
        if "qconfig" in module.__dict__:
            replacement.qconfig = module.qconfig
        replacement.train(module.training)
        if name:
            model.set_submodule(name, replacement)
        else:
            raise ConfigValidationError(
                f"the model itself is torch.ao's {cls.__name__}; prepare the model that holds it",
                field="model", value=cls.__name__)


def _qplug_twin(module: nn.Module, name: str) -> nn.Module:
    cls = type(module)
    if cls.__name__ in _SAME_ROLE:
        return _SAME_ROLE[cls.__name__]()
    fused = getattr(intrinsic, cls.__name__, None)  # the float fused Sequentials, not their QAT twins
    if isinstance(module, nn.Sequential) and isinstance(fused, type) and issubclass(fused, intrinsic.FusedModule):
        return fused(*module.children())
    raise ConfigValidationError(
        f"module {name!r} is torch.ao's {cls.__module__}.{cls.__qualname__}: qplug's eager prepare takes "
        "float modules (fused by qp.eager.fuse_modules) and qplug's QuantStub, DeQuantStub and "
        "FloatFunctional (qplug_core.eager); docs/migrating.md maps each torch.ao name to qplug's",
        field=name, value=cls.__name__)
