#!/usr/bin/env python3
"""The Python binding's overhead per select call (make bench-python).

For each cache, the same pqc_cache_select call (same cache, layer, queries and
selection) is timed in loops: in C (pqcpy_time_select in python/libpqcache.c), called
straight through ctypes ("ctypes"), and through Cache.select ("binding"), timed here.
The kinds of loop take turns --reps times; the figures are the medians of the per-call
times, and "paired" the median difference binding - C of loops run side by side. The
smallest cache shows the overhead best: its select is short, so the machine's noise is
small. The binding's own code is also timed alone, with the C call replaced by a stub.
Last, it checks that K/V arrays of the stored dtype reach the library without a copy."""

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "python"))
import pqcache  # noqa: E402


def overhead(rt, tokens, kv_heads, q_heads, d, loop_s, reps):
    """Median per-call microseconds: in C, through the binding, and their paired difference."""
    rng = np.random.default_rng(1)
    cache = pqcache.Cache(rt, n_layers=1, n_kv_heads=kv_heads, n_q_heads=q_heads, head_dim=d, budget_ratio=0.1,
                          seed=1)
    k = rng.standard_normal((tokens, kv_heads, d), dtype=np.float32)
    cache.prefill(0, k, k)
    q = rng.standard_normal((q_heads, d), dtype=np.float32)
    sel = cache.selection()
    cache.select(0, q, out=sel)  # waits for the build
    one = cache.time_select(0, q, sel, 20) / 20
    calls = max(10, int(loop_s / one))

    def in_c():
        return cache.time_select(0, q, sel, calls) / calls

    def in_python():
        t0 = time.perf_counter()
        for _ in range(calls):
            cache.select(0, q, out=sel)
        return (time.perf_counter() - t0) / calls

    bare, args = pqcache.lib.pqc_cache_select, (cache._ptr, 0, q.ctypes.data, sel._ref)

    def in_ctypes():  # the C function called straight through ctypes, no binding code
        t0 = time.perf_counter()
        for _ in range(calls):
            bare(*args)
        return (time.perf_counter() - t0) / calls

    loops = [in_c, in_ctypes, in_python]
    for loop in loops:  # warm every path
        loop()
    times = [[] for _ in loops]
    for rep in range(reps):  # rotate which loop goes first
        for i in range(len(loops)):
            j = (i + rep) % len(loops)
            times[j].append(loops[j]())
    cache.close()
    cs, bares, pys = times
    paired = statistics.median(p - c for p, c in zip(pys, cs))
    return statistics.median(cs) * 1e6, statistics.median(bares) * 1e6, statistics.median(pys) * 1e6, paired * 1e6


def binding_alone(rt, reps):
    """Microseconds of Cache.select's Python code per call, the C call stubbed out."""
    cache = pqcache.Cache(rt, n_layers=1, n_kv_heads=1, n_q_heads=4, head_dim=64)
    k = np.ones((100, 1, 64), np.float32)
    cache.prefill(0, k, k)
    q = np.ones((4, 64), np.float32)
    sel = cache.selection()
    real, pqcache._select = pqcache._select, lambda *args: 0
    try:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(10000):
                cache.select(0, q, out=sel)
            times.append((time.perf_counter() - t0) / 10000)
    finally:
        pqcache._select = real
    cache.close()
    return statistics.median(times) * 1e6


def zero_copy(rt):
    """True when prefill and append hand the caller's own buffers to the library."""
    rng = np.random.default_rng(2)
    ok = []
    for dtype, store in ((np.float32, "f32"), (np.float16, "f16")):
        cache = pqcache.Cache(rt, n_layers=1, n_kv_heads=4, head_dim=64, kv_dtype=store)
        k = rng.standard_normal((2048, 4, 64)).astype(dtype)
        v = rng.standard_normal((2048, 4, 64)).astype(dtype)
        nk = rng.standard_normal((4, 64)).astype(np.float32)
        seen = pqcache._pass_hook = []
        try:
            cache.prefill(0, k, v)
            cache.append(0, nk, nk)
        finally:
            pqcache._pass_hook = None
        want = [("K", k.ctypes.data), ("V", v.ctypes.data), ("K", nk.ctypes.data), ("V", nk.ctypes.data)]
        ok.append((store, seen == want))
        cache.close()
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loop-ms", type=float, default=20, help="length of each timed loop")
    ap.add_argument("--reps", type=int, default=41, help="timed loops of each kind, alternating")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    print("pqcache %s, %s, %d threads; select calls through the binding vs the same calls in C"
          % (pqcache.version(), pqcache.lib.path, args.threads))
    print("%-36s %9s %9s %9s %9s %9s" % ("cache (1 layer, budget 0.1)", "C us", "ctypes", "binding", "diff us",
                                         "paired"))
    with pqcache.Runtime(threads=args.threads) as rt:
        first = None
        for tokens, kv_heads, q_heads, d in ((1024, 1, 4, 64), (4096, 2, 8, 64), (16384, 8, 32, 128)):
            c_us, bare_us, py_us, paired = overhead(rt, tokens, kv_heads, q_heads, d, args.loop_ms / 1e3, args.reps)
            first = paired if first is None else first
            name = "%dK tokens, %d KV / %d q heads, d %d" % (tokens // 1024, kv_heads, q_heads, d)
            print("%-36s %9.1f %9.1f %9.1f %9.1f %9.1f" % (name, c_us, bare_us, py_us, py_us - c_us, paired))
        print("binding overhead per select (the smallest cache's paired difference): %.1f us (target < 5 us)"
              % first)
        print("the binding's Python code alone (C call stubbed): %.1f us per select" % binding_alone(rt, 9))
        for store, ok in zero_copy(rt):
            print("K/V in %s arrays of the stored dtype handed over without a copy: %s"
                  % (store, "yes" if ok else "NO"))


if __name__ == "__main__":
    main()
