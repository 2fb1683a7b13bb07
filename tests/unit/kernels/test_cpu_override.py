"""``override_cpu_flags`` is per thread: prepare takes a 32-bit-accumulation view of the CPU
inside one (``weight_bits.mark``), and another thread quantizing meanwhile must keep deciding for
the CPU it runs on (four threads with fbgemm and qnnpack lost convert's per-layer weight bits)."""

from __future__ import annotations

import threading

from qplug_core.kernels.cpu import cpu_int8, override_cpu_flags


def test_an_override_in_one_thread_is_not_seen_by_another():
    entered, release = threading.Event(), threading.Event()

    def hold_override():
        with override_cpu_flags("avx2 avx512f avx512bw avx512_vnni"):
            entered.set()
            release.wait(10)

    with override_cpu_flags("fpu sse2 avx avx2 fma"):
        holder = threading.Thread(target=hold_override)
        holder.start()
        try:
            assert entered.wait(10)
            assert not cpu_int8().vnni and "avx512_vnni" not in cpu_int8().flags
        finally:
            release.set()
            holder.join()
        with override_cpu_flags("avx2 avx512_vnni"):  # nested: the innermost, then back
            assert cpu_int8().vnni
        assert not cpu_int8().vnni
