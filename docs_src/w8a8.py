"""qp.quantize_w8a8: SmoothQuant + int8 weights and per-token int8 activations; generate() kept."""

import tempfile
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import qplug_core as qp

config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
torch.manual_seed(0)
model = LlamaForCausalLM(config).eval()
prompt = torch.randint(0, 512, (1, 16))

# A few batches of the kind of text the model will see (token ids, or dicts of model inputs).
calibration = [torch.randint(0, 512, (4, 64)) for _ in range(4)]
w8a8 = qp.quantize_w8a8(model, calibration)  # alpha="auto": SmoothQuant strength per input

info = w8a8.qplug_w8a8
print(type(w8a8).__name__, len(info.layers), "int8 linears, GEMM:", info.gemm)
for entry in info.smoothed[:3]:  # where each input's scales were folded (free at run time)
    print(f"  {entry.into} -> {', '.join(entry.layers)} (alpha {entry.alpha})")
print("left float:", info.skipped["lm_head"])
with torch.no_grad():
    tokens = w8a8.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)

# qp.quantize on a generating model takes the same path (and says so).
same = qp.quantize(model, (prompt,), calibration)
assert type(same) is LlamaForCausalLM

# Save, then load into a model built from the same class and config.
with tempfile.TemporaryDirectory() as folder:
    path = qp.save(w8a8, Path(folder) / "llama-w8a8.safetensors")
    loaded = qp.load(path, model=LlamaForCausalLM(config).eval())
    with torch.no_grad():
        again = loaded.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
assert torch.equal(tokens, again)
