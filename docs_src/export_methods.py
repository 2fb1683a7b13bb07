"""Quantize CLIP's get_image_features and get_text_features, and call options fixed at capture."""

import functools

import torch
from transformers import CLIPConfig, CLIPModel

import qplug_core as qp

torch.manual_seed(0)
config = CLIPConfig(
    text_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                 "vocab_size": 100, "max_position_embeddings": 16, "bos_token_id": 0, "eos_token_id": 2},
    vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                   "image_size": 32, "patch_size": 16},
    projection_dim=16)
model = CLIPModel(config).eval()
images = [(torch.randn(2, 3, 32, 32),) for _ in range(4)]
texts = [(torch.randint(3, 100, (2, 8)),) for _ in range(4)]

# a bound method is captured as the graph's forward; model itself is not changed
image_features = qp.quantize(model.get_image_features, images[0], images, backend="fbgemm")
text_features = qp.quantize(model.get_text_features, texts[0], texts, backend="fbgemm")

x, ids = images[1][0], texts[1][0]
with torch.no_grad():
    int8 = image_features(pixel_values=x).pooler_output  # the method's output object, int8 inside
    assert torch.cosine_similarity(int8, model.get_image_features(pixel_values=x).pooler_output).min() > 0.99
    int8 = text_features(input_ids=ids).pooler_output
    assert torch.cosine_similarity(int8, model.get_text_features(input_ids=ids).pooler_output).min() > 0.99
    print(model(input_ids=ids, pixel_values=x).logits_per_image.shape)  # the float CLIPModel as it was

# a call option other than the default: quantize a functools.partial that gives it
hidden = qp.quantize(functools.partial(model.get_image_features, output_hidden_states=True),
                     images[0], images, backend="fbgemm")
print(len(hidden(x, output_hidden_states=True).hidden_states))  # 2: embeddings and the one layer
