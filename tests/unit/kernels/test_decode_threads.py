"""The one-thread choice for short decode kernels: measured per key and thread count, again every REMEASURE_EVERY calls, the
caller's thread count restored after every call (also when the call raises), results unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qplug_core.kernels import decode_threads
from qplug_core.kernels.per_token import PerTokenDynamicLinear, onednn_usable


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    decode_threads.clear()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)
    decode_threads.clear()


def test_the_choice_is_measured_once_and_the_thread_count_restored(two_threads):
    seen = []

    def call():
        seen.append(torch.get_num_threads())
        return len(seen)

    decode_threads.run_with_fastest_threads("k", call)
    choices = decode_threads.single_thread_choices()
    assert set(choices) == {("k", 2)}
    assert sorted(set(seen)) == [1, 2]  # both settings were timed
    assert torch.get_num_threads() == 2
    seen.clear()
    decode_threads.run_with_fastest_threads("k", call)
    assert seen == [1 if choices[("k", 2)] else 2] and torch.get_num_threads() == 2


def test_the_choice_is_measured_again_as_the_load_changes(two_threads):
    seen = []

    def call():
        seen.append(torch.get_num_threads())

    for _ in range(decode_threads.REMEASURE_EVERY - 1):
        decode_threads.run_with_fastest_threads("k", call)
    seen.clear()
    decode_threads.run_with_fastest_threads("k", call)
    assert sorted(set(seen)) == [1, 2] and len(seen) > 1  # both timed again, then the call
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("single", [True, False])
def test_a_known_choice_sets_the_threads_of_the_call_only(two_threads, single):
    decode_threads._cache[("k", 2)] = single
    assert decode_threads.run_with_fastest_threads("k", torch.get_num_threads) == (1 if single else 2)

    def fails():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        decode_threads.run_with_fastest_threads("k", fails)
    assert torch.get_num_threads() == 2


def test_one_thread_needs_no_measurement():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        decode_threads.clear()
        assert decode_threads.run_with_fastest_threads("k", torch.get_num_threads) == 1
        assert decode_threads.single_thread_choices() == {}
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not onednn_usable(), reason="oneDNN's x86 int8 kernels")
@pytest.mark.parametrize("single", [True, False])
def test_a_decode_token_gives_the_same_output_on_either_choice(two_threads, single):
    torch.manual_seed(0)
    module = PerTokenDynamicLinear.from_float(nn.Linear(96, 40), gemm="onednn")
    x = torch.randn(1, 1, 96)
    with torch.no_grad():
        torch.set_num_threads(1)
        want = module(x)
        torch.set_num_threads(2)
        decode_threads._cache[(("onednn-one-token", 96, 40), 2)] = single
        got = module(x)
    assert torch.equal(got, want) and torch.get_num_threads() == 2
