"""qp.quantize_weights: int4 weights with group scales on a Llama decoder that keeps generate()."""

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

# RTN: no data. Each linear runs the fastest correct kernel found on this CPU.
int8 = qp.quantize_weights(model, bits=8, group_size=32)
# GPTQ on a few calibration batches (token ids, or dicts of model inputs).
calibration = [torch.randint(0, 512, (4, 64)) for _ in range(4)]
int4 = qp.quantize_weights(model, bits=4, group_size=32, symmetric=False, algorithm="gptq",
                           calibration_data=calibration, skip=[r"model\.layers\.0\..*"])

info = int4.qplug_weight_only
print(type(int4).__name__, len(info.layers), "layers quantized;", "kernels:", set(info.kernels.values()))
print("left float:", sorted(info.skipped)[:2], "...")
with torch.no_grad():
    tokens = int4.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
print(tokens.shape)

# Save, then load into a model built from the same class and config.
with tempfile.TemporaryDirectory() as folder:
    path = qp.save(int4, Path(folder) / "llama-int4.safetensors")
    loaded = qp.load(path, model=LlamaForCausalLM(config).eval())
    # For a big model, build it on the meta device: nothing is allocated, the file's tensors become its own.
    with torch.device("meta"):
        empty = LlamaForCausalLM(config).eval()
    from_meta = qp.load(path, model=empty)
    with torch.no_grad():
        again = loaded.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(from_meta.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0), again)
assert torch.equal(tokens, again)
