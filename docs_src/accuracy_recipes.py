"""Recipes, sensitivity and accuracy targets on small models (the figures in the guide are from bench/)."""

import torch
from torch import nn

import qplug_core as qp
from qplug_core.config.defaults import default_qconfig_mapping
from qplug_core.zoo.transformer import make_realistic_bert

torch.manual_seed(0)

# 1. Per-tensor weights on a depthwise chain: cross-layer equalization + bias correction ("dfq").
cnn = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU6(),
                    nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.ReLU(),
                    nn.Conv2d(16, 8, 1)).eval()
with torch.no_grad():
    cnn[2].weight.mul_(torch.logspace(-2, 1, 16).view(16, 1, 1, 1))  # trained-like channel spread
images = [(torch.randn(4, 3, 16, 16),) for _ in range(4)]
per_tensor = default_qconfig_mapping("static", per_channel=False)
plain = qp.quantize(cnn, images[0], images, backend="reference", qconfig_mapping=per_tensor,
                    recipe="none")
dfq = qp.quantize(cnn, images[0], images, backend="reference", qconfig_mapping=per_tensor,
                  recipe="dfq")
x = torch.randn(4, 3, 16, 16)
print(f"per-tensor {qp.sqnr(cnn(x), plain(x)):.1f} dB, with dfq {qp.sqnr(cnn(x), dfq(x)):.1f} dB")

# 2. Which layers hurt? Each one alone int8, and each one alone left float.
ranking = qp.sensitivity(cnn, images[0], images, backend="reference", qconfig_mapping=per_tensor)
ranking.print()  # a table; ranking.to_dict() for JSON
print("keeping this one float helps most:", ranking.layers[0].name)

# 3. An accuracy target: the fewest layers leave static int8 (fallback: the CPU's ladder).
bert = make_realistic_bert(seed=0, layers=1, hidden=64, heads=4, intermediate=128)
g = torch.Generator().manual_seed(1)
tokens = [(torch.randint(0, 1000, (2, 16), generator=g), torch.ones(2, 16)) for _ in range(3)]
qmodel = qp.quantize(bert, tokens[0], tokens, backend="reference",
                     target=qp.Target(cosine=0.9999, group="role"))
result = qmodel.meta["qplug_target"]
print("target met:", result.met, "| out of static int8:", result.float_layers or "none")

# 4. Per-token dynamic int8 for transformers, no tracing and no calibration.
per_token = qp.quantize_dynamic(bert, backend="reference", per_token=True)
print(f"per-token dynamic: {qp.sqnr(bert(*tokens[0]), per_token(*tokens[0])):.1f} dB")
