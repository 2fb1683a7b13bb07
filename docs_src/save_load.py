"""Save a quantized model to one .safetensors file and load it back, without unpickling."""

import tempfile
from pathlib import Path

import torch
from torch import nn

import qplug_core as qp

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
data = [torch.randn(8, 16) for _ in range(4)]
qmodel = qp.quantize(model, data[0], data, backend="fbgemm")

path = Path(tempfile.mkdtemp()) / "model.safetensors"
qp.save(qmodel, path)  # int8 weights, qparams and the graph as JSON; no pickle, no code

loaded = qp.load(path)  # rebuilt and lowered with the installed fbgemm plugin
x = torch.randn(2, 16)
torch.testing.assert_close(loaded(x), qmodel(x))
reference = qp.load(path, backend="reference")  # the same model, simulated: runs anywhere
print(f"{qp.sqnr(loaded(x), reference(x)):.1f} dB between fbgemm kernels and the reference form")

# A pickle is refused outright; there is no opt-in.
pickle_path = path.with_suffix(".pt")
torch.save(model.state_dict(), pickle_path)
try:
    qp.load(pickle_path)
except qp.errors.UnsafeFileError as error:
    print(error)
