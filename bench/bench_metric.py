#!/usr/bin/env python3
"""Codebook metrics on real models' captured keys and queries, side by side outside the
sequence cache's own derivation (make bench-metric).

The library's default metric (PQC_METRIC_QUERY) is a matrix per sub-space (a band of
rotation pairs): W_j = C_j / mean(diag C_j) + floor I, C_j the observed queries' second
moments over the band's dims. Here "band" reaches the same distance through a map, with
Euclidean codebooks: with W_j = L_j L_j^T (Cholesky), the keys handed to the cache are
L_j^T k and the queries L_j^-1 q, band by band, so every q.k is unchanged while the
cache's codebooks (metric "l2") see the distance (k - c)^T W_j (k - c). Other maps try
metrics the library does not have. Selections are scored against exact attention on the
model's own, untransformed queries and keys.

Metrics: diag (PQC_METRIC_QUERY_DIAG: the observed queries' mean square per dimension,
tied within each RoPE pair, plus metric_floor), band (the above), rotate (one map for
the whole head, the sub-spaces no longer rope bands: the observed queries' second moments
C over all d_h dims with the same floor, y = C^1/2 k, then y's principal axes dealt to the
sub-spaces by eigenvalue allocation, as OPQ's parametric form does), oracle (every coded
token scored exactly).

Captures (one dense forward pass each, through transformers, keys and queries after RoPE):
  mass     the half's haystack, its last 16 tokens decoded teacher-forced: attention mass
           kept of exact top-k's at the same per-head counts (bench_real's "mass");
  needles  a passkey at each depth (bench_real's prompt, the half's needle form), its
           answer teacher-forced: of the passkey's tokens that exact top-k would select
           at each layer, head and step, the share the selection keeps ("needle tokens
           kept").
Each metric runs with several k-means seeds (the needle figure moves with them).

usage: bench_metric.py [--model smollm2|gemma3] [--half tune|report] [--length N]
       [--depths 0.1,...] [--seeds 1,2,3] [--metrics diag,band,oracle] [--floor F]
"""
import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_real as B  # noqa: E402
import pqcache  # noqa: E402  (bench_real put python/ on the path)

N_OBS = 32


def capture(M, ids, n_q):
    """per pqcache layer (K, V, the last n_q queries), keys and queries after RoPE"""
    _, cap = M.prompt(ids, n_obs=n_q)
    return [cap[layer] for layer in M.full]


def band_maps(qo, hq, hkv, d, m, floor):
    """per KV head (Mk, Mq), d x d, block-diagonal over the rope bands of the half-split
    layout: k' = Mk k, q' = Mq q, q'.k' = q.k"""
    g, half = hq // hkv, d // 2
    per = half // m
    maps = []
    for h in range(hkv):
        qh = qo[:, h * g:(h + 1) * g].reshape(-1, d).astype(np.float64)
        mk, mq = np.zeros((d, d)), np.zeros((d, d))
        for j in range(m):
            p = np.arange(j * per, (j + 1) * per)
            dims = np.concatenate([p, p + half])
            c = qh[:, dims].T @ qh[:, dims] / len(qh)
            c = c / (np.trace(c) / len(dims)) + floor * np.eye(len(dims))
            lc = np.linalg.cholesky(c)
            mk[np.ix_(dims, dims)] = lc.T
            mq[np.ix_(dims, dims)] = np.linalg.inv(lc)
        maps.append((mk, mq))
    return maps


def rotate_maps(qo, k, hq, hkv, d, m, floor):
    """per KV head (Mk, Mq) over the whole head: whitening by the observed queries'
    second moments, then the keys' principal axes there, dealt to the m sub-spaces so
    that the products of their variances stay even (eigenvalue allocation)"""
    g, per = hq // hkv, d // m
    maps = []
    for h in range(hkv):
        qh = qo[:, h * g:(h + 1) * g].reshape(-1, d).astype(np.float64)
        c = qh.T @ qh / len(qh)
        c = c / (np.trace(c) / d) + floor * np.eye(d)
        w, u = np.linalg.eigh(c)
        a, ai = u @ np.diag(np.sqrt(w)) @ u.T, u @ np.diag(1 / np.sqrt(w)) @ u.T
        y = k[:, h].astype(np.float64) @ a.T
        ev, v = np.linalg.eigh(np.cov(y.T))
        buckets, logp = [[] for _ in range(m)], np.zeros(m)
        for i in np.argsort(-ev):
            j = min((j for j in range(m) if len(buckets[j]) < per), key=lambda j: logp[j])
            buckets[j].append(i)
            logp[j] += np.log(max(ev[i], 1e-12))
        r = v.T[[i for b in buckets for i in b]]
        maps.append((r @ a, r @ ai))
    return maps


def run(M, cap, steps, metric, seed, floor, where=None):
    """(mean mass ratio, worst, needle tokens wanted, kept) of one metric and seed"""
    layers, hq, hkv, d = M.shape
    g, nl = hq // hkv, len(cap)
    m = max(4, d // 32)   # the library's default m at these widths (rope bands divide d/2)
    settings = dict(budget_ratio=B.BUDGET, seed=seed)
    if metric in ("band", "rotate"):
        settings["metric"] = "l2"
    if metric == "diag":
        settings["metric"] = "query_diag"
    if metric == "oracle":
        settings["rerank"] = 1e6
    c = pqcache.Cache(M.runtime, n_layers=nl, n_q_heads=hq, n_kv_heads=hkv, head_dim=d,
                      rope="none" if metric == "rotate" else "half",
                      softmax_scale=d ** -0.5, **settings)
    n = cap[0][0].shape[0]
    t0, nq = n - steps, cap[0][2].shape[0]
    maps = []

    def tk(i, k):
        mk = maps[i]
        return np.ascontiguousarray(np.stack([k[..., h, :] @ mk[h][0].T for h in range(hkv)], -2), dtype=np.float32)

    def tq(i, q):
        mk = maps[i]
        return np.ascontiguousarray(np.concatenate([q[..., h * g:(h + 1) * g, :] @ mk[h][1].T for h in range(hkv)], -2),
                                    dtype=np.float32)
    for i, (k, v, q) in enumerate(cap):
        qo = q[nq - steps - N_OBS:nq - steps]
        maps.append(band_maps(qo, hq, hkv, d, m, floor) if metric == "band" else
                    rotate_maps(qo, k[:t0], hq, hkv, d, m, floor) if metric == "rotate" else
                    [(np.eye(d), np.eye(d))] * hkv)
        c.observe(i, tq(i, qo))
        c.prefill(i, tk(i, k[:t0]), np.ascontiguousarray(v[:t0]))
    c.sync()
    ratios, want, kept = [], 0, 0
    for s in range(steps):
        t = t0 + s
        for i, (k, v, q) in enumerate(cap):
            c.append(i, tk(i, k[t]), np.ascontiguousarray(v[t]))
            qt = q[nq - steps + s]
            sel = c.select(i, tq(i, qt))
            for h in range(hkv):
                sc = (qt[h * g:(h + 1) * g] @ k[:t + 1, h].T) * d ** -0.5
                p = np.exp(sc - sc.max(1, keepdims=True))
                pm = (p / p.sum(1, keepdims=True)).sum(0)
                ch = np.asarray(sel[h], dtype=np.int64)
                ratios.append(pm[ch].sum() / np.sort(pm)[::-1][:len(ch)].sum())
                if where is not None:
                    top = np.argpartition(-pm, len(ch) - 1)[:len(ch)] if len(ch) < len(pm) else np.arange(len(pm))
                    w = np.intersect1d(where, top)
                    want += len(w)
                    kept += len(np.intersect1d(w, ch))
    c.close()
    return float(np.mean(ratios)), float(np.min(ratios)), want, kept


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", choices=sorted(B.MODELS))
    ap.add_argument("--models-dir", default=os.path.join(B.ROOT, "build", "models"))
    ap.add_argument("--half", default="tune", choices=["tune", "report"])
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    ap.add_argument("--key", type=int, default=0, help="passkey (default: the half's first)")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--metrics", default="diag,band,oracle", help="diag, band, rotate, oracle")
    ap.add_argument("--floor", type=float, default=1.0, help="band: the floor over each band's mean weight")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    M = B.Model(os.path.join(a.models_dir, B.MODELS[a.model]["dir"]), a.threads)
    h = B.HALVES[a.half]
    hay = M.tok(B.haystack(h["haystack"]), add_special_tokens=False)["input_ids"]
    key = a.key or h["passkeys"][0]
    seeds = [int(x) for x in a.seeds.split(",")]
    metrics = a.metrics.split(",")
    cells = [("mass", None)] + [("needle %.1f" % float(x), float(x)) for x in a.depths.split(",") if x]
    tot = {mt: [[], 0, 0] for mt in metrics}
    print("%s, %s half, %d tokens, budget %.2f, floor %g, seeds %s" % (a.model, a.half, a.length, B.BUDGET, a.floor,
                                                                        a.seeds), flush=True)
    for name, depth in cells:
        if depth is None:
            cap, steps, where = capture(M, hay[:a.length], 16 + N_OBS), 16, None
        else:
            where = []
            ids = B.needle_prompt(M.tok, hay, h["form"], key, a.length, depth, where)
            ans = M.tok(" %d" % key, add_special_tokens=False)["input_ids"]
            cap, steps = capture(M, ids + ans, len(ans) + N_OBS), len(ans)
            where = np.array(where, dtype=np.int64)
        for mt in metrics:
            res = [run(M, cap, steps, mt, s, a.floor, where) for s in (seeds if mt != "oracle" else seeds[:1])]
            mass = np.mean([r[0] for r in res])
            line = "  %-11s %-6s mass %.4f (worst head-step %.3f)" % (name, mt, mass, min(r[1] for r in res))
            if where is not None:
                w, k = sum(r[2] for r in res), sum(r[3] for r in res)
                line += "  needle tokens kept %.3f (%s)" % (k / max(w, 1), " ".join("%.3f" % (r[3] / max(r[2], 1))
                                                                                     for r in res))
                tot[mt][1] += w
                tot[mt][2] += k
            else:
                tot[mt][0].append(mass)
            print(line, flush=True)
    print("summary (%s half, %d tokens):" % (a.half, a.length))
    for mt in metrics:
        kept = "%.3f" % (tot[mt][2] / tot[mt][1]) if tot[mt][1] else "-"
        print("  %-6s mass %.4f  needle tokens kept %s" % (mt, np.mean(tot[mt][0]), kept))


if __name__ == "__main__":
    main()
