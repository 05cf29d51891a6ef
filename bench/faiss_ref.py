#!/usr/bin/env python3
"""faiss reference figures for the pqcache benchmark.

usage: faiss_ref.py DATAFILE [--threads N] [--reps R] [--search-reps R] [--seed S]
                             [--simd LEVEL] [--configs m2b8,m4b8,m16b4]

Reads a PQCB v1 dataset (see bench/make_test_data.py for the layout), runs faiss on it
and prints one figure a line:

    faiss <metric> <config> <value>

plus `faiss version <x.y.z>`, `faiss simd <text>` and `faiss blas <text>` lines and
comment lines starting with '#'. bench/report.py reads this output.

Run it with OpenBLAS's tuning variables removed from the environment, as the Makefile
does:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE build/venv/bin/python bench/faiss_ref.py ...

OpenBLAS reads them once, when numpy (or faiss) loads its library; a forced core type
set for another program makes numpy's and faiss's BLAS pick the wrong kernels. As a
safety net the script also drops them from its own environment before importing numpy,
and prints a comment when it had to.

What is measured (all on the same data, with the query = the SUM of the g query heads,
which for inner products equals summing the heads' raw scores):
  train_s        ProductQuantizer.train on all s keys, niter=10, fixed seed, other
                 ClusteringParameters at faiss defaults (random init from sampled points,
                 max_points_per_centroid=256: faiss subsamples to 256 * 2^nbits training
                 points per sub-space when s is larger; train_points says how many it
                 used); median over --reps
  mse            mean over the s keys of the per-vector squared reconstruction error,
                 sum over the d dims of (x - decode(encode(x)))^2 (not divided by d)
  mse_rel        mse divided by the mean of ||x||^2
  encode_s       ProductQuantizer.compute_codes for all s keys; median over --reps
  search_ns_per_token
                 IndexPQ (METRIC_INNER_PRODUCT) search of one query for the top k, the
                 file's k; median over --search-reps (>= 5), divided by s
  scan_ns_per_token
                 the same search with k=1: the scan without the cost of a large top-k
  recall         |returned top-k  intersect  exact top-k| / k, exact top-k from numpy
                 argpartition on the float32 inner products (ties irrelevant)
  needle_recall  fraction of the file's needle indices found in the returned top-k
  fastscan_m16b4 IndexPQFastScan (m=16, nbits=4, METRIC_INNER_PRODUCT, bbs=32) built
                 from the trained m16b4 IndexPQ (same codebooks and codes)
  exact_numpy    keys @ q then np.argpartition for the top k
  exact_flatip   faiss IndexFlatIP search with the same k
"""
import argparse
import os
import struct
import sys
import time

OPENBLAS_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


def parse_args(argv):
    ap = argparse.ArgumentParser(description="faiss reference figures for pqcache")
    ap.add_argument("datafile")
    ap.add_argument("--threads", type=int, default=1, help="threads for faiss/BLAS (default 1)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of train/encode (default 3)")
    ap.add_argument("--search-reps", type=int, default=0,
                    help="repetitions of each search (default max(5, 3*reps))")
    ap.add_argument("--seed", type=int, default=1234, help="k-means seed (default 1234)")
    ap.add_argument("--simd", default="",
                    help="force faiss's SIMD level (e.g. AVX2, NONE) where dynamic dispatch allows")
    ap.add_argument("--configs", default="m2b8,m4b8,m16b4",
                    help="PQ configs mXbY, comma separated (default m2b8,m4b8,m16b4)")
    a = ap.parse_args(argv)
    if a.threads < 1 or a.reps < 1:
        ap.error("--threads and --reps must be >= 1")
    if a.search_reps <= 0:
        a.search_reps = max(5, 3 * a.reps)
    a.search_reps = max(5, a.search_reps)
    cfgs = []
    for c in a.configs.split(","):
        c = c.strip()
        try:
            m, b = c[1:].split("b")
            cfgs.append((c, int(m), int(b)))
        except ValueError:
            ap.error("bad config %r (want mXbY)" % c)
    a.cfgs = cfgs
    return a


args = parse_args(sys.argv[1:])

# Before numpy/faiss load their OpenBLAS and OpenMP runtimes.
dropped = [v for v in OPENBLAS_VARS if v in os.environ]
for v in dropped:
    del os.environ[v]
for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[v] = str(args.threads)

import numpy as np  # noqa: E402
import faiss  # noqa: E402

try:
    from threadpoolctl import threadpool_info, threadpool_limits  # noqa: E402
except ImportError:  # optional
    threadpool_info = threadpool_limits = None

MAGIC = b"PQCB"
HEADER = struct.Struct("<4s7I")


def out(metric, config, value):
    if isinstance(value, float):
        value = "%.6g" % value
    print("faiss %s %s %s" % (metric, config, value), flush=True)


def load(path):
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        sys.exit("faiss_ref.py: %s" % e)
    if len(raw) < HEADER.size:
        sys.exit("%s: too short for a PQCB header" % path)
    magic, version, s, d, g, k, nn, _ = HEADER.unpack_from(raw, 0)
    if magic != MAGIC or version != 1:
        sys.exit("%s: not a PQCB v1 file (magic %r version %d)" % (path, magic, version))
    need = HEADER.size + 4 * (s * d + g * d + nn)
    if len(raw) != need or s == 0 or d == 0 or g == 0 or not 0 < k <= s:
        sys.exit("%s: bad sizes (s=%d d=%d g=%d k=%d needles=%d, %d bytes, want %d)"
                 % (path, s, d, g, k, nn, len(raw), need))
    off = HEADER.size
    keys = np.frombuffer(raw, dtype="<f4", count=s * d, offset=off).reshape(s, d)
    off += 4 * s * d
    queries = np.frombuffer(raw, dtype="<f4", count=g * d, offset=off).reshape(g, d)
    off += 4 * g * d
    needles = np.frombuffer(raw, dtype="<u4", count=nn, offset=off)
    return (np.ascontiguousarray(keys, dtype=np.float32),
            np.ascontiguousarray(queries, dtype=np.float32),
            needles.astype(np.int64), k)


def median_time(fn, reps):
    ts = []
    res = None
    for _ in range(reps):
        t0 = time.perf_counter()
        res = fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)), res


def recall(found, exact_set, k):
    found = np.asarray(found).ravel()
    found = found[found >= 0]
    return len(exact_set.intersection(found.tolist())) / float(k)


def needle_recall(found, needles):
    if needles.size == 0:
        return "n/a"
    return float(np.isin(needles, np.asarray(found).ravel()).mean())


def simd_string():
    parts = []
    cfg = getattr(faiss, "SIMDConfig", None)
    if cfg is not None:
        try:
            parts.append(str(cfg.get_level_name()))
        except Exception:  # older faiss
            pass
    opts = faiss.get_compile_options().strip() if hasattr(faiss, "get_compile_options") else ""
    parts.append("(compile options: %s)" % (opts or "unknown"))
    return " ".join(parts)


def main():
    keys, queries, needles, k = load(args.datafile)
    s, d = keys.shape
    g = queries.shape[0]
    q = queries.sum(axis=0, dtype=np.float64).astype(np.float32)[None, :]

    if args.simd:
        cfg = getattr(faiss, "SIMDConfig", None)
        if cfg is None or not hasattr(faiss, "to_simd_level"):
            sys.exit("--simd: this faiss has no dynamic SIMD dispatch")
        cfg.set_level(faiss.to_simd_level(args.simd.upper()))

    faiss.omp_set_num_threads(args.threads)
    limits = threadpool_limits(limits=args.threads) if threadpool_limits else None

    print("# faiss reference: %s" % os.path.basename(args.datafile))
    if dropped:
        print("# note: removed %s from the environment before loading numpy; "
              "run with env -u %s" % (",".join(dropped), " -u ".join(dropped)))
    print("faiss version %s" % faiss.__version__)
    print("faiss simd %s" % simd_string())
    print("faiss numpy %s" % np.__version__)
    if threadpool_info is not None:
        for lib in threadpool_info():
            if lib.get("user_api") == "blas":
                print("faiss blas %s %s %s arch=%s threads=%s" % (
                    os.path.basename(lib.get("filepath", "?")), lib.get("internal_api"),
                    lib.get("version"), lib.get("architecture"), lib.get("num_threads")))
    out("tokens", "all", s)
    out("dim", "all", d)
    out("heads", "all", g)
    out("k", "all", k)
    out("needles", "all", needles.size)
    out("threads", "all", args.threads)
    out("reps", "all", args.reps)
    out("search_reps", "all", args.search_reps)
    print("# mse = mean over keys of sum over dims of (x - decode(encode(x)))^2")
    print("# query = sum of the %d query heads (one search per KV head); "
          "ns_per_token = median search time / s" % g)

    # exact reference
    scores = keys @ q[0]
    exact_idx = np.argpartition(scores, s - k)[s - k:]
    exact_set = set(exact_idx.tolist())
    mean_sq = float(np.mean(np.einsum("ij,ij->i", keys, keys, dtype=np.float64)))
    out("needle_recall", "exact", needle_recall(exact_idx, needles))

    def exact_numpy():
        sc = keys @ q[0]
        return np.argpartition(sc, s - k)[s - k:]

    t, idx = median_time(exact_numpy, args.search_reps)
    out("search_ns_per_token", "exact_numpy", t / s * 1e9)
    out("recall", "exact_numpy", recall(idx, exact_set, k))
    t, _ = median_time(lambda: keys @ q[0], args.search_reps)
    out("dot_ns_per_token", "exact_numpy", t / s * 1e9)

    flat = faiss.IndexFlatIP(d)
    flat.add(keys)
    t, (_, idx) = median_time(lambda: flat.search(q, k), args.search_reps)
    out("search_ns_per_token", "exact_flatip", t / s * 1e9)
    out("recall", "exact_flatip", recall(idx, exact_set, k))
    out("needle_recall", "exact_flatip", needle_recall(idx, needles))
    del flat

    trained = {}
    for name, m, nbits in args.cfgs:
        if d % m:
            print("# %s: d=%d not divisible by m=%d, skipped" % (name, d, m))
            continue
        ksub = 1 << nbits

        def train():
            pq = faiss.ProductQuantizer(d, m, nbits)
            pq.cp.niter = 10
            pq.cp.seed = args.seed
            pq.train(keys)
            return pq

        t, pq = median_time(train, args.reps)
        mppc = pq.cp.max_points_per_centroid
        npts = min(s, ksub * mppc)
        out("train_s", name, t)
        out("train_points", name, npts)
        if npts < s:
            print("# %s: faiss subsampled %d of %d keys for training "
                  "(max_points_per_centroid=%d x %d centroids)" % (name, npts, s, mppc, ksub))

        t, codes = median_time(lambda: pq.compute_codes(keys), args.reps)
        out("encode_s", name, t)
        recon = pq.decode(codes)
        err = float(np.mean(np.sum((keys.astype(np.float64) - recon) ** 2, axis=1)))
        out("mse", name, err)
        out("mse_rel", name, err / mean_sq)

        index = faiss.IndexPQ(d, m, nbits, faiss.METRIC_INNER_PRODUCT)
        index.pq = pq  # copies the trained codebooks
        index.is_trained = True
        assert np.array_equal(faiss.vector_to_array(index.pq.centroids),
                              faiss.vector_to_array(pq.centroids))
        index.add(keys)
        t, (_, idx) = median_time(lambda: index.search(q, k), args.search_reps)
        out("search_ns_per_token", name, t / s * 1e9)
        out("recall", name, recall(idx, exact_set, k))
        out("needle_recall", name, needle_recall(idx, needles))
        t, _ = median_time(lambda: index.search(q, 1), args.search_reps)
        out("scan_ns_per_token", name, t / s * 1e9)
        trained[(m, nbits)] = index

    base = trained.get((16, 4))
    if base is not None:
        fs = faiss.IndexPQFastScan(base, 32)
        t, (_, idx) = median_time(lambda: fs.search(q, k), args.search_reps)
        out("search_ns_per_token", "fastscan_m16b4", t / s * 1e9)
        out("recall", "fastscan_m16b4", recall(idx, exact_set, k))
        out("needle_recall", "fastscan_m16b4", needle_recall(idx, needles))
        t, _ = median_time(lambda: fs.search(q, 1), args.search_reps)
        out("scan_ns_per_token", "fastscan_m16b4", t / s * 1e9)
    else:
        print("# fastscan_m16b4 needs the m16b4 config; skipped")

    if limits is not None:
        limits.restore_original_limits()


if __name__ == "__main__":
    main()
