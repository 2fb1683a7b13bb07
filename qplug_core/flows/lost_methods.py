"""The methods a module's users call besides ``forward`` that its captured graph does not have.

``qp.quantize`` of a whole ``CLIPModel`` returns a GraphModule of its ``forward``:
``get_text_features`` / ``get_image_features`` were gone with nothing said. The methods counted
are the public functions the model's own classes define, not those of torch's or Hugging Face's
base classes (``save_pretrained``, ``get_input_embeddings`` overrides) nor training set-up
(``freeze_feature_encoder``), which a post-training int8 model does not need.
"""

from __future__ import annotations

import inspect

from torch import nn

__all__ = ["lost_methods"]

#: set-up before training: nothing a quantized model's users call
_TRAINING_SETUP = ("freeze", "unfreeze", "init_")


def lost_methods(model: nn.Module, captured: nn.Module) -> list[str]:
    """The public methods of ``model``'s own classes that ``captured`` does not have."""
    classes = type(model).__mro__
    inherited = {name for cls in classes if _library(cls) for name in vars(cls)}
    names = [name for cls in classes if not _library(cls) for name, value in vars(cls).items()
             if inspect.isfunction(value) and not name.startswith(("_", *_TRAINING_SETUP))
             and name not in inherited and not hasattr(captured, name)]
    return list(dict.fromkeys(names))


def _library(cls: type) -> bool:
    """torch's classes and Hugging Face's base classes (``transformers.models.*`` are models)."""
    module = cls.__module__
    return module == "builtins" or module.split(".")[0] == "torch" or (
        module.startswith("transformers.") and not module.startswith("transformers.models."))
