"""qplug called from several threads at once (issue 17): plugins load once, whoever asks first, and
concurrent quantization with two engines gives exactly what running the jobs one by one gives."""

from __future__ import annotations

import copy
import sys
import threading
from typing import Any, Callable

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import InputMismatchError
from qplug_core.kernels.base import pin_engine
from qplug_core.registry import plugins

pytestmark = pytest.mark.usefixtures("installed_backends")

SLOW_PLUGIN = """
import time
from qplug_core.registry.backends import BackendSpec
from qplug_core.registry.hookspecs import hookimpl

time.sleep(0.5)  # a slow import keeps the first caller inside plugin loading


@hookimpl
def qplug_register_backends():
    return [BackendSpec("sluggish", "fake backend")]
"""


def in_threads(jobs: list[Callable[[], Any]], timeout: float = 120) -> list[Any]:
    """Run the jobs in threads released together; an exception is returned, not lost, and a job
    still running after ``timeout`` seconds (deadlocked) leaves None and does not hold up the exit."""
    barrier, results = threading.Barrier(len(jobs)), [None] * len(jobs)

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = jobs[i]()
        except Exception as error:  # noqa: BLE001 - the test inspects it
            results[i] = error

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
    return results


def test_first_calls_from_two_threads_load_the_plugins_once(fake_dist, monkeypatch):
    fake_dist("qplug-sluggish", SLOW_PLUGIN)
    monkeypatch.setenv(plugins.ENV_LOAD, "qplug-sluggish,qplug-fbgemm,qplug-qnnpack")
    plugins.reset()
    results = in_threads([lambda: sorted(i.name for i in qp.list_backends()),
                          lambda: qp.get_backend("fbgemm").name])
    expected = ["fbgemm", "qnnpack", "reference", "sluggish"]
    assert results == [expected, "fbgemm"]
    assert sorted(i.name for i in qp.list_backends()) == expected  # nothing empty was cached
    imported = [r.name for r in plugins.plugin_records() if r.load_seconds is not None]
    assert sorted(imported) == sorted(set(imported))  # each plugin imported once


class Residual(nn.Module):
    """Many small blocks: tracing takes long enough for concurrent traces to overlap."""

    def __init__(self, blocks: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) + x
        return x


torch.manual_seed(0)
MODEL = Residual().eval()  # built once: model construction draws from the global RNG
DATA = [(torch.randn(4, 16, generator=torch.Generator().manual_seed(i)),) for i in range(3)]


def quantize(backend: str):
    return qp.quantize(copy.deepcopy(MODEL), DATA[0], DATA, backend=backend, progress=False)


def outputs(model) -> bytes:
    """Run after the threads joined: kernels without packed weights (quantized add) dispatch on the
    global engine at call time, which another thread's weight packing switches."""
    return torch.cat([model(*batch) for batch in DATA]).numpy().tobytes()


def test_four_threads_quantizing_with_two_engines_match_sequential_runs():
    backends = ["fbgemm", "qnnpack"] * 2
    engine = torch.backends.quantized.engine
    sequential = {backend: outputs(quantize(backend)) for backend in set(backends)}
    for _ in range(3):  # the races this guards against do not show up in every round
        results = in_threads([lambda b=b: quantize(b) for b in backends])
        errors = [r for r in results if isinstance(r, Exception)]
        assert not errors, errors  # e.g. TraceError: CURRENT_PATCHER is None
        assert [outputs(r) == sequential[b] for r, b in zip(results, backends)] == [True] * 4
    assert torch.backends.quantized.engine == engine  # packing under each engine was undone


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_threads_serving_a_new_batch_size_answer_as_one_thread(backend, tmp_path, monkeypatch):
    """A server's threads meeting a batch size the compiled partitions had not seen each compiled
    it, racing in torch's exporter ("Trying to pop empty mode stack"), and the overlapping
    stdout redirections left sys.stdout pointing at a buffer for the rest of the process."""
    monkeypatch.delenv(plugins.ENV_LOAD)  # every installed backend, the compiling ones too
    plugins.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10)).eval()
    x = torch.randn(64, 1, 8, 8)
    int8 = qp.quantize(model, (x[:8],), [(x[i:i + 16],) for i in range(0, 64, 16)], backend=backend)
    loaded = qp.load(qp.save(int8, tmp_path / "m.safetensors"))
    stdout = sys.stdout
    for served in (int8, loaded):
        served(x[:8])  # warm at one batch size, then four threads at another
        for batch in (3, 16):
            got = in_threads([lambda i=i: served(x[i * batch:(i + 1) * batch]) for i in range(4)])
            assert not [g for g in got if isinstance(g, Exception)], got
            expected = [copy.deepcopy(served)(x[i * batch:(i + 1) * batch]) for i in range(4)]
            assert all(torch.equal(g, e) for g, e in zip(got, expected))
    assert sys.stdout is stdout


class AddCatPool(nn.Module):
    """Quantized add, cat and pooling, ops without packed weights, which dispatch on the global
    engine at call time: run under the other engine, both models answer otherwise on some images."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.a, self.b, self.pool = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 1), nn.AvgPool2d(2)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = self.pool(torch.cat([self.a(x) + x, self.b(x)], dim=1))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))


CNN = AddCatPool().eval()
IMAGES = [torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(i)) for i in range(8)]


def lowered(backend: str) -> nn.Module:
    observed = qp.prepare_fx(CNN, qp.get_default_qconfig_mapping(backend=backend), IMAGES[:1], backend=backend)
    for x in IMAGES:
        observed(x)
    return qp.convert_fx(observed, backend=backend)


def serve(model: nn.Module, expected: list[torch.Tensor], rounds: int = 30) -> bool:
    """Whether ``rounds`` passes over the images all answer bit for bit as ``expected``."""
    return all(torch.equal(model(x), e) for _ in range(rounds) for x, e in zip(IMAGES, expected))


@pytest.fixture(scope="module")
def two_engines() -> dict[str, tuple[nn.Module, list[torch.Tensor]]]:
    """An fbgemm and a qnnpack model of the CNN, with their one-thread answers."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv(plugins.ENV_LOAD, "qplug-fbgemm,qplug-qnnpack")
        plugins.reset()
        models = {backend: lowered(backend) for backend in ("fbgemm", "qnnpack")}
    return {backend: (model, [model(x) for x in IMAGES]) for backend, model in models.items()}


def test_fbgemm_and_qnnpack_models_served_in_threads_answer_as_one_thread(two_engines):
    """One thread's forward ran its add under the engine another thread's forward had switched to,
    and the two restored each other's engine out of order: the process was left on qnnpack."""
    engine, interval = torch.backends.quantized.engine, sys.getswitchinterval()
    jobs = ["fbgemm", "fbgemm", "qnnpack"]  # one fbgemm model in two threads, a qnnpack one beside
    sys.setswitchinterval(1e-6)  # threads take turns between any two ops, not every 5 ms
    try:
        assert in_threads([lambda b=b: serve(*two_engines[b]) for b in jobs]) == [True] * 3
    finally:
        sys.setswitchinterval(interval)
    assert torch.backends.quantized.engine == engine


def test_threads_running_one_engine_run_its_models_together(two_engines):
    """Threads needing the same engine share it: neither waits for the other to leave the model."""
    model, expected = two_engines["fbgemm"]
    both_inside = threading.Barrier(2, timeout=10)  # broken if the lease let one thread in at a time

    def meet(*_: Any) -> None:
        both_inside.wait()

    handle = model.head.register_forward_hook(meet)
    try:
        assert in_threads([lambda: serve(model, expected[:1], rounds=1)] * 2) == [True, True]
    finally:
        handle.remove()


class Outer(nn.Module):
    """Runs a qnnpack model inside its own forward, which is pinned to fbgemm."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
        engines = [torch.backends.quantized.engine]
        y = self.inner(x)
        return y, [*engines, torch.backends.quantized.engine]


def test_pinned_models_nested_in_two_threads_answer_as_one_thread(two_engines):
    """Each thread holds fbgemm and then needs qnnpack inside: two threads doing so at once must not
    wait for each other, the inner model runs its engine and the outer gets its own back."""
    inner, expected = two_engines["qnnpack"]
    outer, engine = pin_engine(Outer(inner), "fbgemm"), torch.backends.quantized.engine

    def nest() -> bool:
        calls = [outer(x) for _ in range(5) for x in IMAGES]
        return all(torch.equal(y, e) and engines == ["fbgemm"] * 2
                   for (y, engines), e in zip(calls, expected * 5))

    assert in_threads([nest, nest], timeout=30) == [True, True]
    assert torch.backends.quantized.engine == engine


class Recursive(nn.Module):
    """Calls itself once; the inner call fails in a pre-hook before its forward runs."""

    def forward(self, depth: int) -> str:
        if depth:
            with pytest.raises(ValueError, match="refused"):
                self(depth - 1)
        return torch.backends.quantized.engine


def refuse_depth_0(module: nn.Module, args: tuple[int]) -> None:
    if args[0] == 0:
        raise ValueError("refused")


def test_a_recursive_call_failing_before_its_forward_leaves_the_outer_call_its_engine():
    """The inner call's always-called forward hook ended the outer call's lease (the user's engine
    came back under the outer forward)."""
    model, engine = Recursive(), torch.backends.quantized.engine
    model.register_forward_pre_hook(refuse_depth_0)
    assert pin_engine(model, "fbgemm")(1) == "fbgemm"
    assert torch.backends.quantized.engine == engine


def test_a_forward_that_raises_gives_its_engine_back(two_engines):
    fbgemm, engine = two_engines["fbgemm"][0], torch.backends.quantized.engine
    with pytest.raises(InputMismatchError, match="3 channels"):  # raised inside forward, by the conv
        fbgemm(torch.randn(1, 4, 16, 16))
    assert torch.backends.quantized.engine == engine
    assert in_threads([lambda: serve(*two_engines["qnnpack"], rounds=1)], timeout=30) == [True]
