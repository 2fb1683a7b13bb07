"""Which backends are installed, which one runs here, and how to pick one."""

import qplug_core as qp

for info in qp.list_backends():
    plugin = ", ".join(p["dist"] for p in info.to_dict()["plugins"])
    print(f"{info.name:10} {info.status:12} {plugin:14} {info.n_pattern_configs} patterns, "
          f"{info.n_kernels} kernels {info.reason}")

backend = qp.get_backend()  # no name: fbgemm on x86, qnnpack on ARM, else reference
print("default here:", backend.name)

reference = qp.get_backend("reference")  # always available: simulated int8, the numerical oracle
assert reference.availability().ok

try:
    qp.get_backend("fbgem")
except qp.errors.BackendNotFoundError as error:
    print(error)  # no backend 'fbgem'; did you mean 'fbgemm'? ...
