"""The decode-step thread choice of ``qp.quantize_w8a8`` / ``qp.quantize_weights`` models: one-token
decode steps run on the thread count measured faster (a deterministic timer injected), prompts on
torch's; outputs unchanged, the thread count restored after an exception, kept by ``qp.save`` /
``qp.load`` (the choices made recorded in the file) and ``copy.deepcopy``, and off when asked."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import SerializationError
from qplug_core.kernels import decode_threads
from qplug_core.serialization.files import read_artifact_file, write_artifact_file
from qplug_core.weight_only import decode_step
from qplug_core.weight_only.decode_step import DecodeStepThreads
from tests.unit.kernels.test_decode_threads import FakeClock
from tests.unit.weight_only.test_w8a8 import GREEDY, PROMPTS, batches, decoder

SCHEMES = {"w8a8": lambda m: qp.quantize_w8a8(m, batches(2)),
           "int4": lambda m: qp.quantize_weights(m, bits=4, group_size=32),
           "int8": lambda m: qp.quantize_weights(m, bits=8)}


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def eager_decoder():
    """torch's one-token SDPA kernel rounds differently on 1 thread than on several (its own
    choice, as with ``torch.set_num_threads(1)``); eager attention is exact on both, so only
    qplug's part is compared."""
    model = decoder()
    model.set_attn_implementation("eager")
    return model


def faster_on(model: nn.Module, threads: int) -> FakeClock:
    """Make ``threads`` the faster setting of ``model``'s decode steps."""
    clock = FakeClock({1: 1.0, 2: 5.0} if threads == 1 else {1: 5.0, 2: 1.0})
    model.qplug_decode_threads.clock = clock
    return clock


def thread_log(model: nn.Module) -> list[tuple[int, int]]:
    """(tokens in the call, threads) of every call of the first decoder layer's norm."""
    log: list[tuple[int, int]] = []
    model.model.layers[0].input_layernorm.register_forward_pre_hook(
        lambda module, args: log.append((args[0].shape[1], torch.get_num_threads())))
    return log


def generated(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    with torch.no_grad():
        out = model.generate(PROMPTS[0], output_logits=True, return_dict_in_generate=True, **GREEDY)
    return out.sequences, list(out.logits)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_decode_steps_run_on_the_faster_count_and_prompts_on_torchs(two_threads, scheme):
    qmodel = SCHEMES[scheme](decoder())
    assert isinstance(qmodel.forward, DecodeStepThreads) and qmodel.qplug_decode_threads is qmodel.forward
    faster_on(qmodel, 1)
    log = thread_log(qmodel)
    generated(qmodel)
    prompt, steps = log[0], log[1:]
    assert prompt == (PROMPTS[0].shape[1], 2)
    assert [t for _, t in steps[:8]] == [1, 2] * 4  # measured, interleaved
    assert steps[8:] == [(1, 1)] * (len(steps) - 8)  # then on the faster one
    choice = qmodel.qplug_decode_threads.choices[2, PROMPTS[0].shape[0]]
    assert choice.single is True and choice.totals == {1: 3.0, 2: 15.0}
    assert qmodel.qplug_decode_threads.summary() == {(2, 2): "1 thread(s) (1 thread(s) 3000.0 ms, 2 thread(s) "
                                                             "15000.0 ms)"}
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("threads", [1, 2])
def test_the_choice_does_not_change_tokens_or_logits(two_threads, scheme, threads):
    qmodel = SCHEMES[scheme](eager_decoder())
    qmodel.qplug_decode_threads.enabled = False
    want_tokens, want_logits = generated(qmodel)
    qmodel.qplug_decode_threads.enabled = True
    faster_on(qmodel, threads)
    for _ in range(2):  # while measuring, then on the choice
        tokens, logits = generated(qmodel)
        assert torch.equal(tokens, want_tokens)
        assert all(torch.equal(a, b) for a, b in zip(logits, want_logits, strict=True))


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_weight_only_kernels_in_a_one_thread_step_are_measured_on_torchs_count_too(two_threads, scheme):
    """The step runs on one thread; its weight-only kernels may take the other (their own pools)."""
    decode_threads.clear()
    qmodel = SCHEMES[scheme](eager_decoder())
    faster_on(qmodel, 1)
    generated(qmodel)
    kernels = {name for (name, *_), threads in decode_threads.single_thread_choices() if threads == 2}
    assert kernels == set(qmodel.qplug_weight_only.kernels.values())
    assert torch.get_num_threads() == 2
    decode_threads.clear()


def test_sdpa_models_keep_their_outputs_on_torchs_count(two_threads):
    """Everything reaches the model's own forward unchanged (arguments, KV cache, outputs)."""
    qmodel = SCHEMES["int4"](decoder())
    qmodel.qplug_decode_threads.enabled = False
    want_tokens, want_logits = generated(qmodel)
    qmodel.qplug_decode_threads.enabled = True
    faster_on(qmodel, 2)
    generated(qmodel)  # measured: half of its steps on one thread
    tokens, logits = generated(qmodel)
    assert torch.equal(tokens, want_tokens)
    assert all(torch.equal(a, b) for a, b in zip(logits, want_logits, strict=True))


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_the_thread_count_is_restored_when_a_step_raises(two_threads, error):
    qmodel = SCHEMES["w8a8"](decoder())
    faster_on(qmodel, 1)
    generated(qmodel)  # measured: one thread chosen
    seen = []

    def fail_at_decode(module, args):
        if args[0].shape[1] == 1:
            seen.append(torch.get_num_threads())
            raise error

    qmodel.model.layers[1].input_layernorm.register_forward_pre_hook(fail_at_decode)
    with pytest.raises(type(error)):
        generated(qmodel)
    assert seen == [1] and torch.get_num_threads() == 2


def test_switched_off_every_call_runs_on_torchs_count(two_threads):
    qmodel = SCHEMES["w8a8"](decoder())
    faster_on(qmodel, 1)
    qmodel.qplug_decode_threads.enabled = False
    log = thread_log(qmodel)
    generated(qmodel)
    assert {t for _, t in log} == {2} and qmodel.qplug_decode_threads.choices == {}


def test_one_thread_is_left_alone():
    qmodel = SCHEMES["w8a8"](decoder())
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        generated(qmodel)
    finally:
        torch.set_num_threads(before)
    assert qmodel.qplug_decode_threads.choices == {}


@pytest.mark.parametrize("scheme", ["w8a8", "int4"])
def test_a_loaded_model_gets_it_too(two_threads, tmp_path, scheme):
    qmodel = SCHEMES[scheme](decoder())
    path = qp.save(qmodel, tmp_path / "model.safetensors")
    loaded = qp.load(path, model=decoder(seed=4))
    assert isinstance(loaded.forward, DecodeStepThreads) and loaded.forward.__wrapped__.__self__ is loaded
    assert qp.save(loaded, tmp_path / "again.safetensors").read_bytes() == path.read_bytes()
    faster_on(loaded, 1)
    log = thread_log(loaded)
    tokens, _ = generated(loaded)
    assert (1, 1) in log and torch.equal(tokens, generated(qmodel)[0])


def test_a_loaded_model_starts_from_the_choice_its_file_records(two_threads, tmp_path, monkeypatch):
    """Every load timed the first decode steps again (each replica choosing on its own); the file
    records the choice, reselect=True measures again, and so does a machine with fewer cores."""
    qmodel = SCHEMES["int8"](decoder())
    faster_on(qmodel, 1)
    generated(qmodel)  # measured: one thread at batch 2
    path = qp.save(qmodel, tmp_path / "model.safetensors")
    monkeypatch.setattr(decode_step, "usable_cores", lambda: 2)  # as on the 2-core machine that saved it

    def steps(**kwargs) -> tuple[nn.Module, list[int]]:
        loaded = qp.load(path, model=decoder(seed=4), **kwargs)
        faster_on(loaded, 2)  # what a measurement here would choose
        log = thread_log(loaded)
        generated(loaded)
        return loaded, [threads for tokens, threads in log[1:]]

    loaded, threads = steps()
    assert threads == [1] * len(threads)  # the recorded choice from the first step: nothing timed
    assert loaded.qplug_decode_threads.summary() == {(2, 2): "1 thread(s) (as recorded in the file)"}
    assert qp.save(loaded, tmp_path / "again.safetensors").read_bytes() == path.read_bytes()
    assert steps(reselect=True)[1][:8] == [1, 2] * 4  # measured, interleaved
    monkeypatch.setattr(decode_step, "usable_cores", lambda: 1)
    assert steps()[1][:8] == [1, 2] * 4  # recorded at 2 threads; this machine has 1 core


def test_a_model_saved_straight_after_quantizing_records_a_choice_its_loads_start_from(two_threads, tmp_path,
                                                                                        monkeypatch):
    """A model saved before it had decoded recorded no choice, so every load timed its first decode
    steps; qp.save now makes the batch-1 choice on decode steps of its own."""
    monkeypatch.setattr(decode_step, "usable_cores", lambda: 2)
    qmodel = SCHEMES["int8"](decoder())
    faster_on(qmodel, 1)
    path = qp.save(qmodel, tmp_path / "model.safetensors")
    assert json.loads(read_artifact_file(path)[0])["decode_threads"] == [{"threads": 2, "batch": 1, "single": True}]
    loaded = qp.load(path, model=decoder(seed=4))
    faster_on(loaded, 2)  # what a measurement here would choose
    log = thread_log(loaded)
    with torch.no_grad():
        tokens = loaded.generate(PROMPTS[0][:1], **GREEDY)
    assert [threads for count, threads in log if count == 1] == [1] * 15  # every decode step: nothing timed
    with torch.no_grad():
        assert torch.equal(tokens, qmodel.generate(PROMPTS[0][:1], **GREEDY))


def test_a_forward_that_returns_no_cache_saves_without_a_choice_and_says_so(two_threads, tmp_path,
                                                                                monkeypatch):
    monkeypatch.setattr(decode_step, "usable_cores", lambda: 2)
    qmodel = SCHEMES["int8"](decoder())
    forward = qmodel.qplug_decode_threads.__wrapped__

    def forward_without_cache_output(*args, cache=None, **kwargs):  # a forward of the user's own
        return forward(*args, **kwargs).logits

    monkeypatch.setattr(qmodel.qplug_decode_threads, "__wrapped__", forward_without_cache_output)
    with pytest.warns(UserWarning, match="could not run a one-token decode step of LlamaForCausalLM"):
        path = qp.save(qmodel, tmp_path / "model.safetensors")
    assert "decode_threads" not in json.loads(read_artifact_file(path)[0])


def test_a_copy_steps_itself_with_a_choice_of_its_own(two_threads):
    qmodel = SCHEMES["w8a8"](decoder())
    generated(qmodel)
    twin = copy.deepcopy(qmodel)
    assert twin.forward.__wrapped__.__self__ is twin and twin.qplug_decode_threads is twin.forward
    assert twin.qplug_decode_threads is not qmodel.qplug_decode_threads
    assert torch.equal(generated(twin)[0], generated(qmodel)[0])


def test_a_model_without_a_kv_cache_is_not_wrapped():
    qmodel = qp.quantize_weights(nn.Sequential(nn.Linear(64, 32)), bits=8)
    assert "forward" not in vars(qmodel) and not hasattr(qmodel, "qplug_decode_threads")


@pytest.mark.parametrize("record,problem", [
    ([{"threads": 1, "batch": 1, "single": True}], "1 threads at batch 1 is not a choice"),
    ([{"threads": 2, "batch": 1, "single": "yes"}], r"decode_threads\[0\]\.single: expected true or false"),
    ({"threads": 2}, "decode_threads: expected a JSON list")])
def test_a_damaged_thread_record_is_refused(tmp_path, record, problem):
    path = qp.save(qp.quantize_weights(nn.Sequential(nn.Linear(64, 32)), bits=8, kernel="reference"),
                   tmp_path / "m.safetensors")
    text, tensors = read_artifact_file(path)
    write_artifact_file(path, json.dumps({**json.loads(text), "decode_threads": record}), tensors)
    with pytest.raises(SerializationError, match=problem):
        qp.load(path, model=nn.Sequential(nn.Linear(64, 32)))
