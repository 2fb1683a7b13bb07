"""Calibration throughput with 1 and 2 processes (torch.distributed, gloo) on the same data.

Run: python bench/bench_distributed.py [--model resnet18] [--size 64] [--batches 16]
     [--global-batch 8] [--reps 3]

Static PTQ calibration (fbgemm default mapping: histogram activation observers, each reducing
every batch across ranks) of ``--batches`` global batches. Variants, interleaved in rotating order:

* ``1 proc x 1 thread``: one process calibrates on the global batches;
* ``1 proc x 2 threads``: the same with 2 intra-op threads (what one process gets from 2 cores);
* ``2 procs x 1 thread``: 2 ranks (launched with torchrun), each on its half of every global batch.

Each worker times ``qp.calibrate`` only (after prepare, started together behind a barrier; the
slowest rank counts) and, for the ranks, also the same shard through an unsynchronised copy of
the observed model: the difference is what agreeing across ranks costs. Figures are samples/s.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import machine_line, quiet


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import qplug_core as qp
    from qplug_core import zoo

    torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    generator = torch.Generator().manual_seed(0)
    shape = (args.global_batch, 3, args.size, args.size)
    batches = [torch.randn(shape, generator=generator) for _ in range(args.batches)]
    per_rank = args.global_batch // world
    shard = [b[rank * per_rank:(rank + 1) * per_rank] for b in batches]
    with quiet():
        observed = qp.prepare_fx(zoo.get_model(args.model, seed=0).eval(), None,
                                 (shard[0][:1],), backend="fbgemm")
    local = copy.deepcopy(observed)  # never registered for reduction: local statistics only
    with torch.no_grad():
        local(shard[0])  # warm-up of kernels and allocator
        start = time.perf_counter()
        for batch in shard:
            local(batch)
        local_seconds = time.perf_counter() - start
    if world > 1:
        dist.barrier()
    start = time.perf_counter()
    qp.calibrate(observed, shard, progress=False)
    seconds = time.perf_counter() - start
    if world > 1:
        slowest = torch.tensor([seconds, local_seconds], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        seconds, local_seconds = slowest.tolist()
        dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"seconds": seconds, "local_seconds": local_seconds,
                          "samples": args.batches * args.global_batch}))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_variant(procs: int, threads: int, args: argparse.Namespace) -> dict:
    script = [str(Path(__file__).resolve()), "--worker", "--threads", str(threads),
              "--model", args.model, "--size", str(args.size), "--batches", str(args.batches),
              "--global-batch", str(args.global_batch)]
    if procs == 1:
        command = [sys.executable, *script]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                   "--nproc-per-node", str(procs), "--master-addr", "127.0.0.1",
                   "--master-port", str(_free_port()), *script]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    variants = {"1 proc x 1 thread": (1, 1), "1 proc x 2 threads": (1, 2),
                "2 procs x 1 thread": (2, 1)}
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    names = list(variants)
    for rep in range(args.reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            runs[name].append(run_variant(*variants[name], args))
    print(machine_line())
    print(f"{args.model} {args.size}x{args.size}, {args.batches} global batches of "
          f"{args.global_batch}, fbgemm default static mapping, median of {args.reps}")
    base = statistics.median(r["samples"] / r["seconds"] for r in runs[names[0]])
    print(f"{'variant':<22}{'samples/s':>10}{'vs 1x1':>8}{'sync share':>12}")
    for name in names:
        rate = statistics.median(r["samples"] / r["seconds"] for r in runs[name])
        share = ""
        if variants[name][0] > 1:
            cost = statistics.median(1 - r["local_seconds"] / r["seconds"] for r in runs[name])
            share = f"{100 * cost:.0f}%"
        print(f"{name:<22}{rate:>10.1f}{rate / base:>7.2f}x{share:>12}")


if __name__ == "__main__":
    main()
