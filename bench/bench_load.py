"""``qp.load`` of a ResNet-18 file, this checkout vs an older qplug_core tree, and the name table.

Each variant runs in its own subprocess (two versions of qplug_core cannot share a process); the
subprocesses alternate (rotating order) so machine noise hits both alike. Each child loads the
file once to warm up (plugins, name table), then times ``--loads`` loads and reports the median.
The name table's build time is measured in a fresh process after plugins are loaded.

    git archive <commit> qplug_core | tar -x -C /tmp/before
    python bench/bench_load.py --before /tmp/before [--rounds 5] [--loads 3] [--backend fbgemm]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def child(path: str, loads: int) -> None:
    import torch

    torch.set_num_threads(1)
    import qplug_core as qp

    qp.load(path)  # warm-up: plugins, backends, name table
    times = []
    for _ in range(loads):
        start = time.perf_counter()
        qp.load(path)
        times.append(time.perf_counter() - start)
    print(json.dumps({"core": qp.__file__, "median": statistics.median(times)}))


def table_child() -> None:
    import torch

    torch.set_num_threads(1)
    from qplug_core.config import names
    from qplug_core.registry.backends import get_backend, list_backends

    for info in list_backends():
        get_backend(info.name)
    start = time.perf_counter()
    core = names._core_part()
    middle = time.perf_counter()
    table = names.name_table()
    end = time.perf_counter()
    print(json.dumps({"core_s": middle - start, "backends_s": end - middle, "entries": len(table),
                      "core_entries": len(core)}))


def write_file(directory: Path, backend: str) -> Path:
    import torch

    torch.set_num_threads(1)
    import qplug_core as qp
    from qplug_core.zoo import example_inputs, get_model

    model = get_model("resnet18", seed=0).eval()
    data = [example_inputs("resnet18", batch=1, seed=s) for s in range(2)]
    qmodel = qp.quantize(model, data[0], data, backend=backend)
    return qp.save(qmodel, directory / "resnet18.safetensors")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", type=Path, help="directory holding an older qplug_core/ (required)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--loads", type=int, default=3)
    parser.add_argument("--backend", default="fbgemm")
    parser.add_argument("--child", nargs=2, metavar=("PATH", "LOADS"))
    parser.add_argument("--table-child", action="store_true")
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], int(args.child[1]))
    if args.table_child:
        return table_child()
    if args.before is None:
        parser.error("--before DIR is required")
    sys.path.insert(0, str(REPO / "bench"))
    from _harness import json_child, machine_line

    print(machine_line())
    path = write_file(Path(tempfile.mkdtemp()), args.backend)
    print(f"ResNet-18 ({args.backend}) file: {path.stat().st_size / 1e6:.1f} MB")
    variants = {"before": args.before, "after": None}
    medians: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.rounds):
        order = list(variants)[r % 2:] + list(variants)[:r % 2]
        for name in order:
            medians[name].append(json_child(__file__, [variants[name] or REPO], "--child", str(path),
                                            str(args.loads))["median"])
    for name, values in medians.items():
        print(f"qp.load {name:6s}: median {statistics.median(values) * 1e3:8.1f} ms  "
              f"(per-round medians {', '.join(f'{v * 1e3:.0f}' for v in values)})")
    ratio = statistics.median(medians["after"]) / statistics.median(medians["before"])
    print(f"after / before: {ratio:.3f}")
    tables = [json_child(__file__, [REPO], "--table-child") for _ in range(3)]
    print(f"name table: {tables[0]['entries']} entries ({tables[0]['core_entries']} core); build "
          f"core {statistics.median(t['core_s'] for t in tables) * 1e3:.0f} ms, backends "
          f"{statistics.median(t['backends_s'] for t in tables) * 1e3:.0f} ms (median of 3 processes)")


if __name__ == "__main__":
    main()
