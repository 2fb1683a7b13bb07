"""The one-thread choice for short decode calls: successive calls alternate between the settings and the faster total
decides (a deterministic timer injected), measured per key and thread count and again every ``remeasure_every`` calls,
the caller's thread count restored after every call (also when the call raises), results unchanged."""

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


class FakeClock:
    """A timer whose every reading advances by the cost of the current thread count."""

    def __init__(self, cost: dict[int, float]) -> None:
        self.cost, self.now = cost, 0.0

    def __call__(self) -> float:
        self.now += self.cost[torch.get_num_threads()]
        return self.now


def run(choice, times: int) -> list[int]:
    """The thread counts ``times`` calls ran on."""
    return [choice.run(torch.get_num_threads) for _ in range(times)]


def test_successive_calls_alternate_then_the_faster_total_decides(two_threads):
    clock = FakeClock({1: 1.0, 2: 5.0})
    choice = decode_threads.ThreadChoice(2, remeasure_every=20, clock=clock)
    assert run(choice, 8) == [1, 2] * 4 and choice.single is True
    assert choice.totals == {1: 3.0, 2: 15.0}  # 3 timed calls each: the first pair only warms up
    assert run(choice, 5) == [1] * 5 and torch.get_num_threads() == 2


def test_the_warm_up_pair_does_not_count(two_threads):
    clock = FakeClock({1: 1.0, 2: 2.0})
    choice = decode_threads.ThreadChoice(2, clock=clock)
    clock.cost = {1: 100.0, 2: 2.0}
    run(choice, 1)  # one thread's first call is slow (cold caches)
    clock.cost = {1: 1.0, 2: 2.0}
    run(choice, 7)
    assert choice.single is True and choice.totals == {1: 3.0, 2: 6.0}


def test_the_choice_is_measured_again_as_the_load_changes(two_threads):
    clock = FakeClock({1: 1.0, 2: 5.0})
    choice = decode_threads.ThreadChoice(2, remeasure_every=20, clock=clock)
    run(choice, 19)
    assert choice.single is True and choice.measurements == 1
    clock.cost = {1: 5.0, 2: 1.0}  # the machine went quiet
    assert run(choice, 8) == [1, 2] * 4  # the 20th call starts a new measurement
    assert choice.single is False and choice.measurements == 2
    assert run(choice, 3) == [2, 2, 2]


def test_the_kernel_choice_is_kept_per_key_and_thread_count(two_threads):
    seen = []

    def call():
        seen.append(torch.get_num_threads())
        return len(seen)

    for _ in range(2 * (decode_threads.RUNS + 1)):
        decode_threads.run_with_fastest_threads("k", call)
    choices = decode_threads.single_thread_choices()
    assert set(choices) == {("k", 2)}
    assert sorted(set(seen)) == [1, 2] and torch.get_num_threads() == 2  # both settings were timed
    seen.clear()
    decode_threads.run_with_fastest_threads("k", call)
    assert seen == [1 if choices[("k", 2)] else 2] and torch.get_num_threads() == 2


def chosen(key, threads: int, single: bool) -> None:
    choice = decode_threads.ThreadChoice(threads)
    choice.single = single
    decode_threads._choices[key, threads, threads] = choice


@pytest.mark.parametrize("single", [True, False])
def test_a_known_choice_sets_the_threads_of_the_call_only(two_threads, single):
    chosen("k", 2, single)
    assert decode_threads.run_with_fastest_threads("k", torch.get_num_threads) == (1 if single else 2)

    def fails():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        decode_threads.run_with_fastest_threads("k", fails)
    assert torch.get_num_threads() == 2


def test_a_call_that_raises_while_measured_restores_the_threads_and_still_counts(two_threads):
    choice = decode_threads.ThreadChoice(2, clock=FakeClock({1: 1.0, 2: 5.0}))

    def fails():
        raise KeyboardInterrupt

    for _ in range(8):
        with pytest.raises(KeyboardInterrupt):
            choice.run(fails)
        assert torch.get_num_threads() == 2
    assert choice.single is True


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
        chosen(("onednn-one-token", 96, 40), 2, single)
        got = module(x)
    assert torch.equal(got, want) and torch.get_num_threads() == 2


def test_within_a_budget_a_call_alternates_between_its_callers_count_and_the_budgets(two_threads):
    torch.set_num_threads(1)  # a decode step measured faster on one thread
    choice = decode_threads.ThreadChoice(2, clock=FakeClock({1: 5.0, 2: 1.0}), caller=1)
    assert run(choice, 8) == [1, 2] * 4 and choice.single is False
    assert run(choice, 3) == [2, 2, 2] and torch.get_num_threads() == 1


def test_a_budget_reaches_the_calls_inside_it_only(two_threads):
    torch.set_num_threads(1)
    assert decode_threads.run_within_budget("k", torch.get_num_threads) == 1  # no budget
    with decode_threads.thread_budget(2):
        seen = [decode_threads.run_within_budget("k", torch.get_num_threads)
                for _ in range(2 * (decode_threads.RUNS + 1))]
        assert seen == [1, 2] * (decode_threads.RUNS + 1)
        with decode_threads.thread_budget(1):  # a nested step on one thread: nothing to take
            assert decode_threads.run_within_budget("j", torch.get_num_threads) == 1
        assert torch.get_num_threads() == 1
    assert set(decode_threads.single_thread_choices()) == {("k", 2)}
    torch.set_num_threads(2)
    with decode_threads.thread_budget(2):  # the caller already has the budget
        assert decode_threads.run_within_budget("m", torch.get_num_threads) == 2
    assert set(decode_threads.single_thread_choices()) == {("k", 2)}


def test_a_call_that_raises_within_a_budget_restores_the_callers_count(two_threads):
    torch.set_num_threads(1)
    choice = decode_threads.ThreadChoice(2, caller=1)
    choice.single = False
    decode_threads._choices["k", 2, 1] = choice

    def fails():
        assert torch.get_num_threads() == 2
        raise RuntimeError("boom")

    with decode_threads.thread_budget(2), pytest.raises(RuntimeError, match="boom"):
        decode_threads.run_within_budget("k", fails)
    assert torch.get_num_threads() == 1
    assert decode_threads.run_within_budget("k", torch.get_num_threads) == 1  # the budget ended
