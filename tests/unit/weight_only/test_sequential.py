"""Block-by-block calibration (GPTQ's order): block i+1 is calibrated on what the quantized block i
computes, and only one block's inputs are recorded at a time."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.kernels.weight_only_scheme import WeightOnlyScheme, quantize
from qplug_core.weight_only.sequential import calibrate

pytestmark = pytest.mark.usefixtures("one_thread")
WIDTH, TOKENS = 16, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, *, gate: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x))) * gate  # a keyword input every block takes, like a mask


class Decoder(nn.Module):
    def __init__(self, chained: bool = True) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(50, WIDTH), nn.Linear(WIDTH, 50)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.chained = chained

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        gate = torch.sigmoid(h.mean(-1, keepdim=True))
        if not self.chained:  # two heads on one input: not a chain of blocks
            return self.head(sum(block(h, gate=gate) for block in self.blocks))
        for block in self.blocks:
            h = block(h, gate=gate)
        return self.head(h)


def _model(chained: bool = True) -> Decoder:
    torch.manual_seed(0)
    return Decoder(chained).eval()


def _calibration() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 50, (1, TOKENS), generator=g) for _ in range(3)]


SCHEME = WeightOnlyScheme(bits=4, group_size=None)
NAMES = ["blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down"]


def _rtn_in_place(model: nn.Module, seen: list[dict[str, torch.Tensor]], held: list[int]):
    """A quantizer for :func:`calibrate`: notes what it was given and how many recorded input tensors
    ([rows, features]) are alive, then rounds the weights in place (so the model computes quantized)."""
    rows = TOKENS * len(_calibration())

    def rtn(inputs: dict[str, torch.Tensor]) -> None:
        copies = {id(x) for earlier in seen for x in earlier.values()}
        held.append(sum(1 for o in gc.get_objects()
                        if type(o) is torch.Tensor and o.dim() == 2 and o.shape[0] == rows and id(o) not in copies))
        seen.append({name: x.clone() for name, x in inputs.items()})
        for name in inputs:
            weight = model.get_submodule(name).weight
            weight.copy_(quantize(weight, SCHEME).dequantize())
    return rtn


def test_the_second_block_is_calibrated_on_the_quantized_first_blocks_outputs():
    model, seen, held = _model(), [], []
    reference = copy.deepcopy(model).double()
    how = calibrate(model, NAMES, _calibration(), 1000, _rtn_in_place(model, seen, held))

    with torch.no_grad():  # the definition in float64: block 0 with its rounded weights, on the embeddings
        first = reference.blocks[0]
        floats = []
        for layer in (first.up, first.down):
            floats.append(layer.weight.clone())
            layer.weight.copy_(quantize(layer.weight.float(), SCHEME).dequantize().double())
        hs = [reference.embed(ids) for ids in _calibration()]
        want = torch.cat([first(h, gate=torch.sigmoid(h.mean(-1, keepdim=True))) for h in hs]).reshape(-1, WIDTH)
        first.up.weight.copy_(floats[0]), first.down.weight.copy_(floats[1])
        unquantized = torch.cat([first(h, gate=torch.sigmoid(h.mean(-1, keepdim=True))) for h in hs])

    assert how == "block by block: 2 blocks of blocks"
    assert [sorted(inputs) for inputs in seen] == [["blocks.0.down", "blocks.0.up"], ["blocks.1.down", "blocks.1.up"]]
    got = seen[1]["blocks.1.up"].double()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got - unquantized.reshape(-1, WIDTH)).abs().max() > 1e-2  # the float block's outputs are not it


def test_the_recording_holds_one_blocks_inputs_at_a_time():
    """Recording the whole model held every linear's inputs at once (4 here, 24 blocks' on a Qwen2-0.5B)."""
    model, seen, held = _model(), [], []
    calibrate(model, NAMES, _calibration(), 1000, _rtn_in_place(model, seen, held))
    assert held == [2, 2]  # up's and down's inputs of the block being quantized, nothing else


def test_blocks_that_do_not_chain_are_recorded_with_the_whole_model_and_say_so():
    quantized = qp.quantize_weights(_model(chained=False), bits=4, algorithm="gptq", calibration_data=_calibration(),
                                    kernel="reference")
    info = quantized.qplug_weight_only
    assert info.calibration.startswith("the whole model at once: the blocks of blocks do not chain (block 1")
    assert set(NAMES) <= set(info.layers)


def _calls(module: nn.Module, counts: dict[str, int], name: str):
    def count(*_: object) -> None:
        counts[name] = counts.get(name, 0) + 1
    return module.register_forward_hook(count)


def test_the_blocks_run_only_where_calibration_needs_them_and_the_head_not_at_all():
    """The float run computes block 0 (recording it) and stops after the last block: the head (an
    LLM's 151936-wide lm_head) is not computed when nothing after the blocks is recorded, later
    blocks only pass their inputs on, and the last block's quantized output is not made."""
    model, counts = _model(), {}
    handles = [_calls(model.head, counts, "head"),
               *(_calls(block.up, counts, f"block {i}") for i, block in enumerate(model.blocks))]
    how = calibrate(model, NAMES, _calibration(), 1000, _rtn_in_place(model, [], []))
    for handle in handles:
        handle.remove()
    batches = len(_calibration())
    assert how == "block by block: 2 blocks of blocks"
    # block 0: the float run, then quantized to make block 1's inputs; block 1: its recording.
    # It was 3 and 2 runs, and the head once a batch.
    assert counts == {"block 0": 2 * batches, "block 1": batches}


def test_a_linear_after_the_blocks_is_calibrated_on_the_float_models_inputs_and_not_computed():
    model, seen = _model(), []
    reference = copy.deepcopy(model).double()
    counts: dict[str, int] = {}
    handles = [_calls(model.head, counts, "head"),
               *(_calls(block.up, counts, f"block {i}") for i, block in enumerate(model.blocks))]
    how = calibrate(model, [*NAMES, "head"], _calibration(), 1000, _rtn_in_place(model, seen, []))
    for handle in handles:
        handle.remove()

    with torch.no_grad():  # the definition in float64: the float blocks
        hs = [reference.embed(ids) for ids in _calibration()]
        gates = [torch.sigmoid(h.mean(-1, keepdim=True)) for h in hs]
        want = [reference.blocks[1](reference.blocks[0](h, gate=g), gate=g) for h, g in zip(hs, gates)]

    assert how == "block by block: 2 blocks of blocks"
    assert sorted(seen[0]) == ["blocks.0.down", "blocks.0.up", "head"]
    torch.testing.assert_close(seen[0]["head"].double(), torch.cat(want).reshape(-1, WIDTH), atol=1e-5, rtol=1e-5)
    batches = len(_calibration())  # block 1 computes in the float run too, for the head's inputs
    assert counts == {"block 0": 2 * batches, "block 1": 2 * batches}  # and the head's matmul never


def test_a_forward_the_blocks_had_on_the_instance_is_theirs_again_after_calibration():
    """(s27 review) the pass-through ended with ``del block.forward``, which also deleted a forward
    set on the instance before (accelerate's offload hooks, a user's wrapper)."""
    model = _model()
    wrapped = model.blocks[1].forward
    model.blocks[1].forward = lambda *args, **kwargs: wrapped(*args, **kwargs)
    own = model.blocks[1].forward
    calibrate(model, NAMES, _calibration(), 1000, _rtn_in_place(model, [], []))
    assert model.blocks[1].__dict__.get("forward") is own and "forward" not in model.blocks[0].__dict__
