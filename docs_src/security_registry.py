"""Config documents name classes by stable names, looked up only in qplug's name table."""

import json

import torch

import qplug_core as qp
from qplug_core.config import register_serializable
from qplug_core.errors import ConfigError
from qplug_core.observers import MinMaxObserver

mapping = qp.get_default_qconfig_mapping("reference")
document = json.dumps(mapping.to_dict())  # plain JSON: classes and functions become names
assert qp.QConfigMapping.from_dict(json.loads(document)).to_dict() == mapping.to_dict()

# A document cannot make qplug import or reach an arbitrary object.
evil = json.loads(document)
evil["global"]["activation"]["class"] = "os.system"
try:
    qp.QConfigMapping.from_dict(evil)
except ConfigError as error:
    print(error)


# Your own observer class must be registered before documents may name it.
class ClippedMinMax(MinMaxObserver):
    pass


register_serializable(ClippedMinMax, name="myproject.ClippedMinMax")
custom = qp.QConfigMapping().set_global(qp.QConfig(
    activation=ClippedMinMax.with_args(dtype=torch.quint8),
    weight=MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)))
print(json.dumps(custom.to_dict())[:120])
assert qp.QConfigMapping.from_dict(custom.to_dict()).to_dict() == custom.to_dict()
