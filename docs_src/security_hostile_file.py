"""A file naming code (here the os.system that qplug_core.cli.app imports) is refused: nothing runs."""

import json
import tempfile
from pathlib import Path

import torch
from torch import nn

import qplug_core as qp

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 4), nn.ReLU()).eval()
data = [torch.randn(4, 8) for _ in range(2)]
path = Path(tempfile.mkdtemp()) / "model.safetensors"
qp.save(qp.quantize(model, data[0], data, backend="reference"), path)

# An attacker edits the JSON header: the first call of the model would run a shell command.
raw = path.read_bytes()
length = int.from_bytes(raw[:8], "little")
header = json.loads(raw[8:8 + length])
document = json.loads(header["__metadata__"]["qplug"])
node = next(n for n in document["model"]["graph"] if n["op"] == "call_module")
node.update(op="call_function", target="qplug_core.cli.app.os.system", args=["touch pwned"])
header["__metadata__"]["qplug"] = json.dumps(document)
del header["__metadata__"]["qplug.digest"]  # the digest finds damage: an attacker drops or rewrites it
text = json.dumps(header).encode()
path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length:])

try:
    qp.load(path)
except qp.errors.SerializationError as error:
    print(error)  # ... unknown or disallowed name 'qplug_core.cli.app.os.system' ...
assert not Path("pwned").exists()
