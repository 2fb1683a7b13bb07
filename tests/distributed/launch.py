"""Run a worker script as the ranks of a local gloo process group (plus, optionally, alone).

Each rank is a plain ``python worker.py`` subprocess with the environment torchrun would give it
(RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, a free MASTER_PORT), so the workers exercise the same
``env://`` initialisation users get. Every process is killed once ``timeout`` seconds have passed.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_env(rank: int, world: int, port: int) -> dict[str, str]:
    """A user's environment (every installed plugin loads), one thread, and the torchrun variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QPLUG_")}
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    return env


def run(command: list[str], *, world: int, with_single: bool = False, timeout: float = 120,
        extra_env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
    """Start ``world`` ranks of ``command`` (and one process with WORLD_SIZE=1 when
    ``with_single``) at once; returns their results, ranks first, after all have ended."""
    port = free_port()
    envs = [worker_env(rank, world, port) for rank in range(world)]
    if with_single:
        envs.append(worker_env(0, 1, free_port()))
    for env in envs:
        env.update(extra_env or {})
    return run_all([(command, env) for env in envs], timeout=timeout)


def run_all(jobs: list[tuple[list[str], dict[str, str]]], *, timeout: float,
            cwd: Path | None = None) -> list[subprocess.CompletedProcess]:
    """Run (command, environment) jobs concurrently. Whatever still runs at ``timeout`` is killed
    and the run fails with what every process printed, so a hang is diagnosed from its log."""
    procs = [subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for command, env in jobs]
    deadline = time.monotonic() + timeout
    results: list[subprocess.CompletedProcess] = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    except subprocess.TimeoutExpired:
        logs = []
        for index, proc in enumerate(procs):
            if index < len(results):
                out, err, state = results[index].stdout, results[index].stderr, f"exit {results[index].returncode}"
            else:
                state = "killed" if proc.poll() is None else f"exit {proc.returncode}"
                proc.kill()
                out, err = proc.communicate()
            logs.append(f"--- process {index} ({state}):\n{out[-2000:]}\n{err[-4000:]}")
        raise AssertionError(f"still running after {timeout:.0f} s:\n" + "\n".join(logs)) from None
    return results


def run_script(script: Path, *args: str, world: int = 2, with_single: bool = False,
               timeout: float = 120, extra_env: dict[str, str] | None = None
               ) -> list[subprocess.CompletedProcess]:
    results = run([sys.executable, str(script), *args], world=world, with_single=with_single,
                  timeout=timeout, extra_env=extra_env)
    for index, result in enumerate(results):
        assert result.returncode == 0, (f"process {index} of {script.name} failed:\n"
                                        f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return results


def join() -> tuple[int, int, str]:
    """(In a worker) one thread, the torchrun environment's process group when WORLD_SIZE > 1;
    returns (rank, world size, file tag: the rank, or "single" for the reference process)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if world > 1:
        dist.init_process_group("gloo")
    return rank, world, "single" if world == 1 else str(rank)


def write_errors(path: Path, attempts: list[Callable[[], object]]) -> None:
    """(In a worker) run each attempt; write the qplug error each raised, ``Type: message`` a line."""
    from qplug_core.errors import QplugError

    messages = []
    for attempt in attempts:
        try:
            attempt()
        except QplugError as error:
            messages.append(f"{type(error).__name__}: {error}")
        else:
            messages.append("no error")
    path.write_text("\n".join(messages))


def saved_model(path: Path) -> tuple[bytes, dict, dict]:
    """What must match byte for byte between ranks and one process: a saved file's tensor bytes, its
    tensor table, and its document without the final check's scores, which each process takes on
    the first calibration batch it saw (a rank's shard of the global batch) and records in the file."""
    import json
    import struct

    data = path.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    document = json.loads(header.pop("__metadata__")["qplug"])
    assert "final_check" in document["model"], f"{path.name} holds no final check"
    document["model"].pop("final_check")
    document["features"].pop("final_check")
    return data[8 + size:], header, document
