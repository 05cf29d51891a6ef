#!/usr/bin/env python3
"""Write a synthetic key/query dataset in the pqcache benchmark format (PQCB v1).

Used to test bench/faiss_ref.py and bench/report.py on their own, and to document what
"LLM-like keys" means for the benchmark. The C benchmark has its own generator that
writes the same format; both sides of a comparison always read the same file.

File layout (little-endian):
    char     magic[4] = "PQCB"
    uint32   version = 1
    uint32   s          tokens
    uint32   d          head dim
    uint32   g          query heads sharing this KV head (GQA group)
    uint32   k          top-k
    uint32   n_needles
    uint32   reserved = 0
    float32  keys[s][d]          post-RoPE keys
    float32  queries[g][d]       post-RoPE queries at decode position s
    uint32   needle_idx[n_needles]

How the keys are made (pre-RoPE, then rotated):
  * clustered content: n_clusters centres with an anisotropic per-dimension scale that
    puts most of the content energy in the low-frequency RoPE pairs (which rotate least
    with position, so what they carry survives RoPE);
    tokens come in runs (mean length 48) that share a centre, centres drawn with a
    Zipf-like popularity, plus Gaussian noise per token;
  * a few large-magnitude channels: n_massive fixed dimensions carry a large, nearly
    constant offset on every token (as the outlier channels of real K projections);
  * RoPE with base 10000 (interleaved pairs (2i, 2i+1), as llama2.c; --rope-layout half
    for the split-halves layout of HF Llama) at positions 0..s-1;
  * needles: n_needles tokens spread over the depth of the context (never in the first
    32 sink positions) get, after RoPE, an extra component of the size of a typical key
    along u_j = 0.8 u0 + 0.6 r_j: a direction u0 shared by all needles (what the query
    looks for, as a passkey's tokens share "passkey-ness") and one of their own r_j
    (orthogonal to u0). Every query head carries 0.5 |typical key| along u0, so the
    needles rank at the very top of the exact inner products while being a handful of
    outliers that k-means tends to average into the bulk. Queries are at position s, so
    they too are post-RoPE; their bulk part is a mix of cluster centres plus a small
    component on the massive channels.
"""
import argparse
import struct
import sys

import numpy as np

MAGIC = b"PQCB"
VERSION = 1
HEADER = struct.Struct("<4s7I")


def rope(x, pos, base, layout):
    """Rotate rows of x (n, d) by RoPE at positions pos (n,). Returns float32."""
    n, d = x.shape
    half = d // 2
    inv_freq = base ** (-np.arange(half, dtype=np.float64) * 2.0 / d)
    ang = pos[:, None].astype(np.float64) * inv_freq[None, :]
    c = np.cos(ang).astype(np.float32)
    s = np.sin(ang).astype(np.float32)
    out = np.empty_like(x, dtype=np.float32)
    if layout == "interleaved":
        a, b = x[:, 0::2], x[:, 1::2]
        out[:, 0::2] = a * c - b * s
        out[:, 1::2] = a * s + b * c
    else:
        a, b = x[:, :half], x[:, half:]
        out[:, :half] = a * c - b * s
        out[:, half:] = a * s + b * c
    return out


def make(s, d, g, k, n_needles, seed=0, n_clusters=48, n_massive=4, base=10000.0,
         layout="interleaved", needle_strength=1.0, chunk=16384):
    rng = np.random.default_rng(seed)

    # anisotropic per-dimension scale: content energy grows towards the low-frequency
    # RoPE pairs (pair i rotates by base^(-2i/d) per position), with some jitter
    pair_of_dim = np.arange(d) // 2 if layout == "interleaved" else np.arange(d) % (d // 2)
    dim_scale = (0.35 + 1.3 * (pair_of_dim / (d / 2.0)) ** 2) * rng.uniform(0.7, 1.3, d)
    centres = (rng.standard_normal((n_clusters, d)) * dim_scale).astype(np.float32)

    # massive channels: both elements of a few low-frequency RoPE pairs (large i rotates
    # slowest), large and nearly constant over tokens
    if layout == "interleaved":
        pairs = rng.choice(np.arange(d // 4, d // 2), size=max(1, n_massive // 2), replace=False)
        massive = np.concatenate([2 * pairs, 2 * pairs + 1])
    else:
        pairs = rng.choice(np.arange(d // 4, d // 2), size=max(1, n_massive // 2), replace=False)
        massive = np.concatenate([pairs, pairs + d // 2])
    massive_val = (rng.choice([-1.0, 1.0], size=massive.size) *
                   rng.uniform(8.0, 14.0, size=massive.size)).astype(np.float32)

    # runs of tokens sharing a cluster, popularity ~ 1/(rank+1)
    pop = 1.0 / (np.arange(n_clusters) + 1.0)
    pop /= pop.sum()
    n_runs = s // 16 + 1
    run_len = rng.geometric(1.0 / 48.0, size=n_runs)
    while run_len.sum() < s:
        run_len = np.concatenate([run_len, rng.geometric(1.0 / 48.0, size=n_runs)])
    run_cluster = rng.choice(n_clusters, size=run_len.size, p=pop)
    assign = np.repeat(run_cluster, run_len)[:s]

    keys = np.empty((s, d), dtype=np.float32)
    for lo in range(0, s, chunk):
        hi = min(s, lo + chunk)
        x = centres[assign[lo:hi]] + \
            (0.55 * rng.standard_normal((hi - lo, d)) * dim_scale).astype(np.float32)
        x[:, massive] += massive_val * (1.0 + 0.05 * rng.standard_normal((hi - lo, massive.size))).astype(np.float32)
        keys[lo:hi] = rope(x, np.arange(lo, hi), base, layout)

    # needles, planted after RoPE along their own random directions
    sinks = min(32, s // 4)
    if n_needles > 0:
        depth = (np.arange(n_needles) + 0.5) / n_needles
        needle_idx = (sinks + depth * (s - sinks - 1)).astype(np.uint32)
        needle_idx = np.unique(needle_idx)
    else:
        needle_idx = np.zeros(0, dtype=np.uint32)
    typical = float(np.median(np.linalg.norm(keys[:: max(1, s // 4096)], axis=1)))
    u0 = rng.standard_normal(d)
    u0 /= np.linalg.norm(u0)
    r = rng.standard_normal((needle_idx.size, d))
    r -= np.outer(r @ u0, u0)
    r /= np.linalg.norm(r, axis=1, keepdims=True)
    u = (0.8 * u0[None, :] + 0.6 * r).astype(np.float32)
    keys[needle_idx] += needle_strength * typical * u

    # queries at position s: a shared content part, per-head variation, the massive
    # channels (a constant bias over all tokens, as real queries carry) and the needles
    w = rng.dirichlet(np.ones(n_clusters) * 0.3)
    q_content = (w @ centres) / max(1e-6, float(np.linalg.norm(w @ centres))) * typical
    q = np.empty((g, d), dtype=np.float32)
    for h in range(g):
        qh = 0.7 * q_content + 0.5 * typical * (rng.standard_normal(d) * dim_scale) / np.sqrt(d)
        qh[massive] += 0.3 * np.sign(massive_val)
        q[h] = qh
    q = rope(q, np.full(g, s), base, layout)
    if needle_idx.size:
        q += (0.5 * typical * u0)[None, :].astype(np.float32)
    return keys, q.astype(np.float32), needle_idx.astype(np.uint32)


def write(path, keys, queries, needle_idx, k):
    s, d = keys.shape
    g = queries.shape[0]
    with open(path, "wb") as f:
        f.write(HEADER.pack(MAGIC, VERSION, s, d, g, k, needle_idx.size, 0))
        f.write(np.ascontiguousarray(keys, dtype="<f4").tobytes())
        f.write(np.ascontiguousarray(queries, dtype="<f4").tobytes())
        f.write(np.ascontiguousarray(needle_idx, dtype="<u4").tobytes())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="output file")
    ap.add_argument("--s", type=int, default=32768, help="tokens (default 32768)")
    ap.add_argument("--d", type=int, default=128, help="head dim (default 128)")
    ap.add_argument("--g", type=int, default=4, help="query heads per KV head (default 4)")
    ap.add_argument("--k", type=int, default=0, help="top-k (default ceil(s/10))")
    ap.add_argument("--needles", type=int, default=8, help="planted needles (default 8)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rope-base", type=float, default=10000.0)
    ap.add_argument("--rope-layout", choices=["interleaved", "half"], default="interleaved")
    a = ap.parse_args(argv)
    if a.d % 2 or a.s < 64 or a.g < 1:
        ap.error("need even d, s >= 64, g >= 1")
    k = a.k if a.k > 0 else -(-a.s // 10)
    keys, q, needles = make(a.s, a.d, a.g, k, a.needles, seed=a.seed, base=a.rope_base,
                            layout=a.rope_layout)
    write(a.out, keys, q, needles, k)
    qs = q.sum(axis=0)
    sc = keys @ qs
    rank = (sc[None, :] > sc[needles][:, None]).sum(axis=1) if needles.size else []
    print("wrote %s: s=%d d=%d g=%d k=%d needles=%d (exact ranks of needles: %s)"
          % (a.out, a.s, a.d, a.g, k, needles.size, " ".join(str(int(r)) for r in rank)),
          file=sys.stderr)


if __name__ == "__main__":
    main()
