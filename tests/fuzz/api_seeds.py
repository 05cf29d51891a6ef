#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_api (tests/fuzz/corpus/api/) from readable programs.

Each helper appends the bytes one operation of fuzz_api.c reads, in the order it reads
them; a value is the index into the field's table of ordinary values, or bad(i) for
entry i of its table of hostile values. Keep this in step with fuzz_api.c.

usage: python3 tests/fuzz/api_seeds.py [OUTPUT_DIR]   (default tests/fuzz/corpus/api)
"""
import os
import sys


def bad(i):
    return 224 + i


class P:
    """A program: the header, then operations."""

    def __init__(self, threads=0, submit=0, simd=0, limit=0, inject=0, n=0, seed=1):
        self.b = bytearray([threads | submit << 2 | simd << 4, limit | inject << 2, n, seed & 255, seed >> 8])

    def raw(self, *xs):
        self.b += bytes(xs)
        return self

    # matrices and vectors: dtype, flags (stride mode | pattern << 3 | scale << 5), value seed, specials
    def mat(self, dtype=0, flags=0, vseed=1, specials=()):
        self.raw(dtype, flags, vseed, len(specials))
        for r, c, kind in specials:
            self.raw(r & 255, r >> 8, c & 255, c >> 8, kind)
        return self

    def vec(self, pat=0, specials=()):
        self.raw(pat, len(specials))
        for at, kind in specials:
            self.raw(at & 255, at >> 8, kind)
        return self

    def create(self, slot=0, strict=None, layers=0, kvh=1, group=1, dim=0, dtype=0, maxt=0, sink=1, window=1, ratio=1, budget=0,
               share=1, m=2, bits=1, iters=1, init=0, mppc=0, seed=1, device=0, gqa=0, bt=2, blocks=2, admit=0,
               policy=0, rebuild=0, resident=0, metric=0, mfloor=0, observe=0, split=0, rope=0, subsp=0, rerank=0,
               outl=0, resw=0, backend=0, rt=0, scale=None):
        # scale: None = the default softmax scale, else an entry of the table (bad(i): hostile)
        if strict is None:  # hostile fields need the hostile mode
            strict = 255 if 224 <= max(layers, kvh, group, dim, dtype, maxt, sink, window, ratio, budget, share, m, bits,
                                       iters, init, mppc, device, gqa, bt, blocks, admit, policy, rebuild, resident,
                                       metric, mfloor, observe, split, rope, subsp, rerank, outl, resw, backend,
                                       scale or 0) else 0
        if scale is not None:
            rt |= (28 + scale - 224 if scale >= 224 else 24 + scale) << 3
        return self.raw(0, slot, strict, layers, kvh, group, dim, dtype, maxt, sink, window, ratio, budget, share, m, bits, iters,
                        init, mppc, seed, device, gqa, bt, blocks, admit, policy, rebuild, resident, metric, mfloor,
                        observe, split, rope, subsp, rerank, outl, resw, backend, rt)

    def prefill(self, slot=0, layer=0, rows=14, mode=0, k=None, v=None):
        self.raw(1, slot, layer, mode, rows)
        self.mat(**(k or {}))
        return self.mat(**(v or {}))

    def append(self, slot=0, layer=0, mode=0, k=None, v=None):
        self.raw(2, slot, layer, mode)
        self.vec(**(k or {}))
        return self.vec(**(v or {}))

    def sel_init(self, slot=0, which=0):
        return self.raw(3, slot, which)

    def select(self, slot=0, layer=0, which=0, mode=0, q=None):
        self.raw(4, slot, layer, which, mode)
        return self.vec(**(q or {}))

    def fetch(self, slot=0, layer=0, which=0, mode=0):
        return self.raw(5, slot, layer, which, mode)

    def fetch_rows(self, slot=0, layer=0, which=0, mode=0):
        return self.raw(6, slot, layer, which, mode)

    def sync(self, slot=0):
        return self.raw(7, slot)

    def info(self, slot=0, what=0, layer=0, head=2):
        return self.raw(8, slot, what, layer, head)

    def report(self, slot=0, layer=0, tok=0, sec=0):
        return self.raw(9, slot, layer, tok, sec)

    def driver_prefill(self, slot=0, pos=0, n=0, qkv_fail=0, attend_fail=0, special=0):
        return self.raw(10, slot, pos, n, qkv_fail, attend_fail, special)

    def driver_decode(self, slot=0, pos=0, qkv_fail=0, attend_fail=0, special=0):
        return self.raw(11, slot, pos, qkv_fail, attend_fail, special)

    def batch_select(self, n=1, w0=0, w1=0, arr=0, layer=0, qs=({}, {})):
        self.raw(12, n, w0, w1, arr, layer)
        for q in qs:
            self.vec(**q)
        return self

    def batch_fetch(self, n=1, w0=0, w1=0, arr=0, layer=0):
        return self.raw(13, n, w0, w1, arr, layer)

    def sel_hand(self, slot=0, which=1, heads=0, cap=0, fill=0, counts=(0, 0)):
        return self.raw(14, slot, which, heads, cap, fill, *counts)

    def sel_tamper(self, slot=0, which=0, what=0, head=0, pos=0):
        return self.raw(15, slot, which, what, head, pos & 255, pos >> 8)

    def destroy(self, slot=0):
        return self.raw(16, slot)

    def fork(self, parent=0, child=1):  # child slot == parent slot: the fork is dropped again
        return self.raw(28, parent | child << 1)

    def save_load(self, saved=0, loaded=1):  # loaded slot == saved slot: compared, then dropped
        return self.raw(29, saved | loaded << 1)

    def pq_train(self, slot=0, flags=6, dim=0, rows=9, m=2, bits=1, iters=1, init=0, mppc=0, seed=1, device=0, rope=0,
                 subsp=0, k=None):
        self.raw(17, slot, flags, dim, rows, m, bits, iters, init, mppc, seed, device, rope, subsp)
        return self.mat(**(k or {}))

    def codes_init(self, cs=0, ps=0, how=0, cap=2):
        return self.raw(18, cs, ps, how, cap)

    def codes_reserve(self, cs=0, cap=4):
        return self.raw(19, cs, cap)

    def encode(self, ps=0, cs=0, flags=0, rows=9, k=None):
        self.raw(20, ps, cs, flags, rows)
        return self.mat(**(k or {}))

    def search(self, ps=0, cs=0, flags=0, first=0, count=0, g=1, k=1, q=None):
        self.raw(21, ps, cs, flags, first, count, g, k)
        return self.vec(**(q or {}))

    def exact(self, flags=0, dim=0, g=1, rows=9, k=1, keys=None, q=None):
        self.raw(23, flags, dim, g, rows, k)
        self.mat(**(keys or {}))
        return self.vec(**(q or {}))

    def topk(self, flags=0, pat=0, n=0, k=2, specials=()):
        self.raw(24, flags, pat, len(specials), n, k)
        for at, kind in specials:
            self.raw(at & 255, at >> 8, kind)
        return self

    def sched_create(self, tmin=0, tmax=0, tdef=0, par=0, alloc=1):
        return self.raw(25, 0, tmin, tmax, tdef, par, alloc)

    def sched_kmeans(self, tok=0, sec=0, iters=0):
        return self.raw(25, 1, tok, sec, iters)

    def sched_compute(self, tok=0, sec=0):
        return self.raw(25, 2, tok, sec)

    def sched_iters(self, tok=0, jobs=0):
        return self.raw(25, 3, tok, jobs)

    def observe(self, slot=0, layer=0, mode=2, q=None):  # mode % 5 query rows
        self.raw(27, slot, layer, mode)
        return self.vec(**(q or {})) if mode % 5 else self

    def convert(self, h=0x3c00, bits=0x3f800000):
        return self.raw(26, h & 255, h >> 8, bits & 255, bits >> 8 & 255, bits >> 16 & 255, bits >> 24)


# indices into the special values of fuzz_api.c
NAN_, INF, NINF, E30, F70000 = 0, 1, 2, 3, 4


def seeds():
    s = {}
    # prefill, decode steps, select, fetch and fetch_rows on a two-head cache with GQA 2
    p = P().create(kvh=1, group=1, sink=1, window=1).prefill(rows=14).sel_init()
    for _ in range(3):
        p.append()
    p.select().fetch().fetch_rows().select().fetch().info(what=1).info(what=3).sync()
    s["pipeline"] = p
    # the same on two layers, fp16 storage, fp16 and bf16 input, LRU, a window from the budget
    p = P().create(layers=1, kvh=2, dim=2, dtype=1, window=0, policy=1, bits=0, blocks=1)
    p.prefill(layer=0, rows=9, k={"dtype": 1}, v={"dtype": 2, "flags": 5}).prefill(layer=1, rows=9)
    p.sel_init().select(layer=0).fetch(layer=0).append(layer=0).append(layer=1).select(layer=1).fetch(layer=1)
    s["fp16_two_layers"] = p
    # a finite fp32 key above the fp16 range into fp16 storage, then the layer's build
    p = P().create(dtype=1, iters=0).prefill(rows=14, k={"specials": [(50, 2, F70000)]}).sel_init().select().sync()
    s["fp16_overflow_key"] = p
    # max_tokens below 16 sinks: a sequence shorter than its sinks, one-token blocks
    p = P().create(maxt=6, sink=5, bt=3).prefill(rows=4).sel_init().select().fetch().fetch_rows()
    s["tiny_max_tokens"] = p
    # a huge n_sink
    p = P().create(sink=bad(0)).prefill(rows=14).sel_init().select().fetch().append().select().fetch()
    s["huge_sink"] = p
    # a fetch before any prefill, with an empty hand-made selection; then on a layer without one
    p = P().create(layers=1).sel_hand(which=1, heads=0, cap=5, counts=(0, 0)).fetch(layer=0, which=1)
    p.fetch_rows(layer=1, which=1).prefill(layer=0, rows=14).fetch(layer=1, which=1)
    s["fetch_before_prefill"] = p
    # selections whose count exceeds their capacity: the last head's reads past the array
    p = P().create().prefill(rows=14).sel_hand(which=1, cap=2, counts=(0, bad(0))).fetch_rows(which=1).fetch(which=1)
    p.sel_init().select().sel_tamper(what=0, head=1).fetch_rows().fetch()
    s["count_over_capacity"] = p
    # hand-made selections: unsorted, one past the end
    p = P().create().prefill(rows=14).sel_hand(which=1, cap=2, fill=5 << 2, counts=(0, 0)).fetch(which=1)
    p.sel_hand(which=1, cap=2, fill=6 << 2, counts=(0, 0)).fetch(which=1)
    s["bad_selections"] = p
    # budget_tokens = SIZE_MAX
    p = P().create(budget=bad(0), window=0).prefill(rows=14).sel_init().select().fetch()
    s["budget_size_max"] = p
    # block-cache slots whose size overflows: d_h 65536, 2^30-token blocks, 2^15 blocks
    p = P().create(kvh=0, group=0, dim=bad(2), bt=bad(5), blocks=bad(5), sink=2, window=4, m=1, bits=3).prefill(rows=2)
    p.sel_init().select().fetch()
    s["slot_size_overflow"] = p
    # K and V of different dtypes (fp32 K, fp16 V) on a two-head cache
    p = P().create().prefill(rows=1, k={"dtype": 0}, v={"dtype": 1}).prefill(rows=1, k={"dtype": 2}, v={"dtype": 0})
    s["prefill_mixed_dtypes"] = p
    # a prompt whose row count wraps tokens + rows
    p = P().create().prefill(rows=14).prefill(rows=14, mode=0x76)
    s["rows_wrap"] = p
    # the driver: prefill, decode steps, an attend callback failing at layer 1
    p = P().create(layers=1, kvh=1, group=2).driver_prefill(n=3).driver_decode().driver_decode()
    p.driver_decode(attend_fail=bad(1)).driver_decode(qkv_fail=bad(0))
    s["driver"] = p
    # two caches in a batch
    p = P(threads=3).create(slot=0).create(slot=1).prefill(slot=0, rows=14).prefill(slot=1, rows=12)
    p.sel_init(slot=0).sel_init(slot=1).batch_select(n=1).batch_fetch(n=1)
    s["batch"] = p
    # worker threads: builds in the background, a destroy while they run
    p = P(threads=3).create(layers=1, iters=2).prefill(layer=0, rows=15).prefill(layer=1, rows=15).destroy()
    s["threads_destroy"] = p
    # injected allocation failures from the 40th request on
    p = P(inject=2, n=40).create().prefill(rows=14).sel_init().select().fetch().append().select().fetch()
    s["oom_injection"] = p
    # a 64 KiB request limit
    p = P(limit=2).create(maxt=1).prefill(rows=14).sel_init().select().fetch()
    s["small_limit"] = p
    # the PQ core: train (runtime vs scalar), codes, encode, search, exact search, top-k
    p = P().pq_train(rows=9).codes_init(cap=2).encode(rows=9).search(count=0, k=2, g=1).search(flags=8, first=1, k=1)
    p.exact(rows=9, k=2).topk(n=5, k=3).topk(pat=1, n=6, k=4).raw(22, 0, 0)
    s["pq_core"] = p
    # codes with capacities whose byte size wraps
    p = P().pq_train(rows=9).codes_init(cap=bad(3)).codes_init(cs=1, cap=2).codes_reserve(cs=1, cap=bad(1))
    p.codes_reserve(cs=1, cap=bad(9)).encode(cs=1, rows=9)
    s["codes_capacity_wrap"] = p
    # the scheduler with Inf and 1e200 token counts among valid samples, then its iteration count
    p = P().sched_create().sched_kmeans(tok=0).sched_kmeans(tok=bad(3)).sched_kmeans(tok=2)
    p.sched_compute(tok=0).sched_compute(tok=2).sched_compute(tok=bad(3)).sched_compute(tok=bad(5)).sched_iters()
    s["scheduler_inf"] = p
    # t_min 5, t_max 50, t_default 1: the iteration count for an out-of-range token count
    p = P().sched_create(tmin=3, tmax=4, tdef=3).sched_iters(tok=bad(3)).sched_iters(tok=bad(6))
    s["scheduler_iters_range"] = p
    # a scheduler behind a cache (pq.iters = 0), fed by the driver and by reports
    p = P().sched_create().create(layers=1, iters=4, backend=1).driver_prefill(n=3).report(tok=0, sec=0)
    p.report(tok=3, sec=1).report(layer=1, tok=1, sec=2).driver_decode().sched_iters()
    s["scheduler_cache"] = p
    # odd strides, unknown dtypes, NaN keys
    p = P().create().prefill(rows=14, k={"flags": 6}, v={"flags": 4}).prefill(rows=5, k={"dtype": bad(0)})
    p.prefill(rows=5, k={"specials": [(1, 1, NAN_)]}).prefill(rows=5, mode=0x0e)
    s["matrix_shapes"] = p
    p = P().convert().convert(h=0x7c01, bits=0x477fe000).convert(h=0x0001, bits=0x00000001)
    s["conversions"] = p
    # decode steps past the rebuild share: 2-centroid codebooks, rebuild at 10% new tokens
    p = P().create(kvh=0, group=2, bits=3, rebuild=2, window=4, blocks=4, bt=1).prefill(rows=9).sel_init()
    for i in range(12):
        p.append()
        if i % 4 == 3:
            p.select().fetch()
    s["rebuild"] = p
    # a device tier of the engine's (its own backend), summed GQA scores, LRU, fp16 storage
    p = P().create(dtype=1, gqa=1, policy=1, backend=4, admit=1).prefill(rows=15).sel_init()
    for _ in range(3):
        p.select().fetch().append()
    p.fetch_rows().info(what=3, head=2)
    s["own_backend"] = p
    # a cache without a runtime; an engine pool that runs jobs inline
    p = P(submit=3).create(rt=7, layers=1).prefill(layer=0, rows=14).prefill(layer=1, rows=14).sel_init()
    p.select(layer=1).fetch(layer=1).fetch_rows(layer=0).sync()
    s["no_runtime"] = p
    # the driver handing rows by pointer (odd first engine byte), two worker threads
    p = P(threads=3).create(layers=1).driver_prefill(n=3, qkv_fail=1).driver_decode(qkv_fail=1)
    p.driver_decode(qkv_fail=1).driver_decode(qkv_fail=1).info(what=1)
    s["driver_row_pointers"] = p
    # observed queries, then sub-spaces of rope bands over the half-split layout (d_h 8,
    # m 2: each sub-space two pairs), the metric tied within pairs
    p = P().create(layers=1, m=2, rope=1, subsp=1).observe(layer=0).observe(layer=1).prefill(rows=14)
    p.prefill(layer=1, rows=14).sel_init().select().fetch().append().select(layer=1).fetch(layer=1).sync()
    s["rope_bands"] = p
    # exact scoring: the PQ top 2k re-ranked with the exact keys, outlier lists of 4 tokens
    # per head, residual-aware scoring; appends code tokens (their residual bytes, and they
    # may join the lists), a failed select gives them back
    p = P().create(layers=1, rerank=1, outl=1, resw=1, ratio=1).prefill(rows=14).prefill(layer=1, rows=14).sel_init()
    p.select().fetch().append().append().select().append(layer=1).select(layer=1).fetch(layer=1).sync()
    s["rerank_exact_list"] = p
    # prefix sharing: a fork decodes on its own, the parent is destroyed first, a fork of
    # the fork replaces it; a fork between the layers of a step is refused
    p = P().create(layers=1, rerank=1, outl=1).prefill(rows=14).prefill(layer=1, rows=14).sel_init().select().fork()
    p.sel_init(slot=1).append(slot=1).select(slot=1).fetch(slot=1).append(slot=1, layer=1).fork(parent=1, child=1)
    p.destroy(slot=0).append(slot=1).select(slot=1, layer=1).fetch(slot=1, layer=1).fork(parent=1, child=0)
    p.append(slot=0).select(slot=0).fetch_rows(slot=0).sync(slot=0)
    s["fork_family"] = p
    # the driver on a family: prefills of a fork, of its parent, and after a decode step,
    # when the rows of each lie in two parts (the shared prefix and their own)
    p = P().create(layers=1).driver_prefill(n=6).fork().driver_prefill(slot=1, n=1).driver_prefill(slot=0, n=2)
    p.driver_decode(slot=1).driver_prefill(slot=1, n=2).driver_prefill(slot=0, n=5)
    s["driver_on_forks"] = p
    # the driver on loaded caches: a saved prompt loaded (its rows mapped from the file),
    # decoded and extended by a second turn; a fork's save; the saved cache goes on too
    p = P().create(layers=1).driver_prefill(n=6).save_load().driver_decode(slot=1).driver_prefill(slot=1, n=2)
    p.driver_decode(slot=1).fork(parent=1, child=0).save_load(saved=0, loaded=0).driver_prefill(slot=0, n=3)
    p.save_load(saved=1, loaded=1).sel_init(slot=1).select(slot=1).fetch(slot=1).fetch_rows(slot=1)
    s["driver_on_loads"] = p
    # a rebuilding cache with outlier lists and re-ranking saved mid-decode and loaded
    p = P().create(rebuild=2, rerank=1, outl=1).prefill(rows=14).sel_init()
    for _ in range(4):
        p.append().select()
    p.save_load().sel_init(slot=1).append(slot=1).select(slot=1).fetch(slot=1)
    s["load_rebuilding"] = p
    # failed decode steps while rebuilds fall due (a share of 0.1, the inline runtime): a
    # step whose append starts a build and whose select installs it, then fails at its
    # attend callback, gives everything back; a save after it loads; re-ranking, outliers
    p = P().create(layers=1, rebuild=2, rerank=1, outl=1, bits=1).driver_prefill(n=4)
    for i in range(40):
        p.driver_decode(attend_fail=bad(i % 2)).driver_decode()
    p.save_load()
    s["driver_failure_installs"] = p
    # a model's softmax scale (4): selections with re-ranking and outlier lists, saved
    # (format version 4) and loaded, the loaded cache going on; and a scale refused
    p = P().create(scale=3, rerank=1, outl=1).prefill(rows=14).sel_init().append().select()
    p.save_load().sel_init(slot=1).append(slot=1).select(slot=1).fetch(slot=1)
    p.create(slot=2, scale=bad(1))
    s["softmax_scale"] = p
    # the PQ core with interleaved rope bands
    s["pq_rope_bands"] = P().pq_train(dim=0, rows=11, m=2, bits=2, rope=2, subsp=1)
    # the default m of wide keys (1024 dims: d_h / 32 = 32 sub-spaces), with the objective
    s["pq_wide_default_m"] = P().pq_train(dim=bad(6), rows=1, m=0, bits=1, iters=1)
    # metric blocks (flags 8): positive definite ones code and search; each broken kind
    # (not symmetric, not positive definite, NaN, with weights) is refused
    p = P().pq_train(flags=14, rows=9, m=2, bits=2, iters=2).raw(0).codes_init(cap=2).encode(rows=9)
    p.search(count=0, k=2, g=1)
    for kind in (1, 2, 3, 4):
        p.pq_train(slot=1, flags=14, rows=9, m=2, bits=2, iters=2).raw(kind)
    s["pq_metric_blocks"] = p
    # the cache's diagonal metric (metric 2, weights): observed queries, rope bands, a save
    # and load, a fork, appends that code with the weights
    p = P().create(layers=1, m=2, rope=1, subsp=1, metric=2).observe(layer=0).observe(layer=1).prefill(rows=14)
    p.prefill(layer=1, rows=14).sel_init().select().fetch().append().append(layer=1).select(layer=1).save_load().fork()
    p.append(slot=1).sel_init(slot=1).select(slot=1).sync()
    s["cache_metric_diag"] = p
    return s


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "corpus", "api")
    os.makedirs(out, exist_ok=True)
    for name, prog in seeds().items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(bytes(prog.b))


if __name__ == "__main__":
    main()
