"""A converted model as a torch.export ExportedProgram (PT2E's quantized_decomposed convention)."""

import tempfile
from pathlib import Path

import torch

# torch defines the quantized_decomposed ops only here; qplug does not import it (see the guide)
import torch.ao.quantization.fx._decomposed  # noqa: F401, TID251

import qplug_core as qp
from qplug_core.zoo import example_inputs, get_model

model = get_model("digits_cnn", seed=0).eval()  # conv-bn-relu, a residual add, max-pool, linear
data = [example_inputs("digits_cnn", batch=4, seed=s) for s in range(4)]
int8 = qp.quantize(model, data[0], data, backend="fbgemm")

# torch.export.export(int8, data[0]) fails inside torch on fbgemm's packed weights; this exports
# the reference form the model keeps: int8 weights, quantize/dequantize ops, float convs and adds
program = qp.export_program(int8, data[0])
print(sorted({str(n.target) for n in program.graph.nodes if "quantized_decomposed" in str(n.target)}))

x = example_inputs("digits_cnn", batch=4, seed=100)
with torch.no_grad():
    print(torch.equal(program.module()(*x), int8(*x)))  # True here; in general within the kernel contract

path = Path(tempfile.mkdtemp()) / "digits.pt2"
torch.export.save(program, path)
loaded = torch.export.load(path)
with torch.no_grad():
    print(torch.equal(loaded.module()(*x), program.module()(*x)))  # True
