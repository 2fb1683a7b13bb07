"""What a big model costs: the copy's float weights let go while ``qp.quantize_weights`` swaps,
the load-time kernel check a block of rows at a time, tied weights written once (weight-only and W8A8 files; dynamic
files go through the same writer, but ``qp.quantize_dynamic`` quantizes a tied ``lm_head`` too)
and tied again at load, and ``qp.load`` into a model built on the meta device."""

from __future__ import annotations

import gc
import json
import os
import warnings
import weakref

import pytest
import torch
from safetensors import safe_open
from torch import nn

import qplug_core as qp
from qplug_core.errors import SerializationError
from qplug_core.serialization import weight_only

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(0))
QUANTIZE = {"weight_only": lambda m: qp.quantize_weights(m, bits=8),
            "w8a8": lambda m: qp.quantize_w8a8(m, [PROMPT], alpha=0.5)}


def qwen2(tied: bool = True, seed: int = 0, meta: bool = False):
    """A tiny Qwen2 whose embedding table is most of its bytes, tied to ``lm_head`` like Qwen2-0.5B's."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tied)
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return Qwen2ForCausalLM(config).eval()
    return Qwen2ForCausalLM(config).eval()


def header(path) -> tuple[list[str], dict]:
    with safe_open(str(path), framework="pt") as file:
        return list(file.keys()), json.loads(file.metadata()["qplug"])


@pytest.mark.parametrize("mode", list(QUANTIZE))
def test_tied_weights_are_written_once_and_tied_again_at_load(tmp_path, mode):
    qmodel = QUANTIZE[mode](qwen2())
    path = qp.save(qmodel, tmp_path / "m.safetensors")
    keys, document = header(path)
    table = qmodel.model.embed_tokens.weight
    assert "float/model.embed_tokens.weight" in keys and "float/lm_head.weight" not in keys
    assert document["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert path.stat().st_size < 1.5 * table.numel() * table.element_size()  # the table once, not twice
    loaded = qp.load(path, model=qwen2(seed=1))
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        assert torch.equal(loaded(PROMPT).logits, qmodel(PROMPT).logits)


def test_a_file_holding_both_tied_copies_still_loads(tmp_path, monkeypatch):
    qmodel = qp.quantize_weights(qwen2(), bits=8)
    monkeypatch.setattr(weight_only, "_tied_keys", lambda state: {})  # the writer before tied keys
    path = qp.save(qmodel, tmp_path / "old.safetensors")
    assert "float/lm_head.weight" in header(path)[0]
    monkeypatch.undo()
    for model in (qwen2(seed=1), qwen2(meta=True)):
        loaded = qp.load(path, model=model)
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()  # one table
        with torch.no_grad():
            assert torch.equal(loaded(PROMPT).logits, qmodel(PROMPT).logits)


def test_a_tied_key_naming_no_tensor_of_the_file_is_refused(tmp_path, monkeypatch):
    qmodel = qp.quantize_weights(qwen2(), bits=8)
    monkeypatch.setattr(weight_only, "_tied_keys", lambda state: {"lm_head.weight": "model.norm.nothing"})
    path = qp.save(qmodel, tmp_path / "bad.safetensors")
    monkeypatch.undo()
    with pytest.raises(SerializationError, match="tied key 'lm_head.weight'"):
        qp.load(path, model=qwen2(seed=1))


@pytest.mark.parametrize("tied", [True, False])
def test_load_into_a_model_built_on_the_meta_device(tmp_path, tied):
    qmodel = qp.quantize_weights(qwen2(tied), bits=8)
    path = qp.save(qmodel, tmp_path / "m.safetensors")
    empty = qwen2(tied, meta=True)
    loaded = qp.load(path, model=empty)
    assert loaded is empty
    assert not [n for n, t in (*loaded.named_parameters(), *loaded.named_buffers()) if t.is_meta]
    assert (loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()) == tied
    with torch.no_grad():
        assert torch.equal(loaded(PROMPT).logits, qmodel(PROMPT).logits)


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 32)
        self.register_buffer("factor", torch.full((32,), 2.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.factor


def test_a_meta_model_whose_unsaved_buffers_nothing_computes_is_refused_by_name(tmp_path):
    path = qp.save(qp.quantize_weights(_Scaled(), bits=8), tmp_path / "m.safetensors")
    with torch.device("meta"):
        empty = _Scaled()
    with pytest.raises(SerializationError, match="built on the meta device and factor are not saved"):
        qp.load(path, model=empty)


def test_quantize_weights_lets_each_float_weight_of_its_copy_go_as_it_swaps_it(monkeypatch):
    from qplug_core.weight_only import api

    swap, seen, alive_at_each_swap = api._quantized_module, [], []

    def watched(module, *args):
        gc.collect()
        alive_at_each_swap.append(sum(ref() is not None for ref in seen))
        seen.append(weakref.ref(module.weight))
        return swap(module, *args)

    monkeypatch.setattr(api, "_quantized_module", watched)
    qp.quantize_weights(qwen2(tied=False), bits=8)
    assert len(seen) == 8 and alive_at_each_swap == [0] * 8  # q k v o gate up down, lm_head


def test_the_kernel_check_dequantizes_a_block_of_rows_at_a_time(tmp_path, monkeypatch):
    from qplug_core.kernels.weight_only_scheme import QuantizedWeight

    out = 1025
    qmodel = qp.quantize_weights(nn.Sequential(nn.Linear(64, out)), bits=4, group_size=32)
    path = qp.save(qmodel, tmp_path / "m.safetensors")
    dequantize, rows = QuantizedWeight.dequantize, []

    def counted(weight, dtype=torch.float32):
        if dtype == torch.float64:  # the check's definition (the reference kernel runs in float32)
            rows.append(weight.shape[0])
        return dequantize(weight, dtype)

    monkeypatch.setattr(QuantizedWeight, "dequantize", counted)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the recorded kernel passes its check: nothing measured again
        loaded = qp.load(path, model=nn.Sequential(nn.Linear(64, out)))
    assert sum(rows) == out and max(rows) < out  # the whole weight, a block of rows at a time
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.equal(loaded(x), qmodel(x))


def test_load_reads_each_byte_of_the_tensors_once_into_storage_of_their_own(tmp_path, monkeypatch):
    qmodel = qp.quantize_weights(qwen2(), bits=8)
    path = qp.save(qmodel, tmp_path / "m.safetensors")
    with safe_open(str(path), framework="pt") as file:
        data = sum(file.get_tensor(key).nbytes for key in file.keys())
    read, pread, preadv = [], os.pread, os.preadv
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: read.append(len(got := pread(fd, n, offset))) or got)
    monkeypatch.setattr(os, "preadv", lambda fd, views, offset: read.append(got := preadv(fd, views, offset)) or got)
    loaded = qp.load(path, model=qwen2(seed=1))
    monkeypatch.undo()
    header = path.stat().st_size - data
    assert data <= sum(read) < data + 4 * header  # the tensors once (and the header a few times), not mapped
    table = loaded.model.embed_tokens.weight
    assert table.untyped_storage().nbytes() == table.nbytes
    with torch.no_grad():
        assert torch.equal(loaded(PROMPT).logits, qmodel(PROMPT).logits)


def test_load_lets_the_float_layers_it_replaces_go_before_packing_kernels(tmp_path, monkeypatch):
    path = qp.save(qp.quantize_weights(qwen2(tied=False), bits=8), tmp_path / "m.safetensors")
    model = qwen2(tied=False, seed=1)
    replaced = [weakref.ref(m.weight) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    pack, alive = weight_only.choose_kernels, []

    def watched(*args, **kwargs):
        gc.collect()
        alive.append(sum(ref() is not None for ref in replaced))
        return pack(*args, **kwargs)

    monkeypatch.setattr(weight_only, "choose_kernels", watched)
    qp.load(path, model=model)
    assert len(replaced) == 8 and alive == [0]
