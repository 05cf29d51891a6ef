#!/usr/bin/env python3
"""Side-by-side summary of the pqcache and faiss benchmark figures.

usage: report.py OURS.txt FAISS.txt

Both files hold lines `<side> <metric> <config> <value>`, with <side> `pqcache` in
OURS.txt and `faiss` in FAISS.txt (bench/faiss_ref.py writes the latter). Lines that start
with '#', lines of the other side and lines that do not parse are ignored; a figure that
is missing shows as "n/a", never as an error.

Figures read (config names: m2b8, m4b8, m16b4 = m sub-spaces of b bits; fastscan_m16b4,
exact_numpy and exact_flatip on the faiss side; `exact` for pqcache's exact selection):

    <side> tokens all <s>            <side> k all <k>        <side> threads all <n>
    <side> version <x.y.z>           <side> simd <text...>
    <side> train_s <cfg> <seconds>   <side> mse <cfg> <mse>  <side> encode_s <cfg> <seconds>
    <side> search_ns_per_token <cfg> <ns>     (one query: table/scan + top-k, time / s)
    <side> scan_ns_per_token <cfg> <ns>       (optional: the scan without a large top-k)
    <side> recall <cfg> <0..1>                <side> needle_recall <cfg> <0..1>
    pqcache train_s_T <cfg> <T> <seconds>     training with T Lloyd iterations
    pqcache mse_T <cfg> <T> <mse>             its quantisation MSE
    pqcache membw_gbs all <GB/s>              (optional) measured read bandwidth

mse is the mean over keys of the squared reconstruction error summed over the d dims.

"train to faiss MSE": faiss trains with niter=10; for pqcache the smallest T in its
sweep whose MSE is at most faiss's MSE times 1.005 (a 0.5% tolerance), and the training
time at that T. Speedups and ratios are faiss time / pqcache time (> 1: pqcache faster).
"""
import math
import sys

CONFIG_ORDER = ["m2b8", "m4b8", "m16b4"]
DEFAULT_CFG = "m4b8"  # the library's default codebook shape (PQC_DEFAULT_M, PQC_DEFAULT_BITS)
MSE_TOL = 0.005


class Figures:
    def __init__(self, side):
        self.side = side
        self.val = {}     # (metric, config) -> float
        self.sweep = {}   # (metric, config) -> {T: float}
        self.text = {}    # metric -> [rest of line, ...]
        self.error = None

    def get(self, metric, config):
        return self.val.get((metric, config))

    def first_text(self, metric):
        t = self.text.get(metric)
        return t[0] if t else None


def parse(path, side):
    f = Figures(side)
    try:
        with open(path, "r", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError as e:
        f.error = str(e)
        return f
    for line in lines:
        tok = line.split()
        if len(tok) < 3 or tok[0] != side or tok[0].startswith("#"):
            continue
        metric = tok[1]
        if metric.endswith("_T") and len(tok) == 5:
            try:
                t, v = float(tok[3]), float(tok[4])
            except ValueError:
                continue
            if math.isfinite(v):
                f.sweep.setdefault((metric, tok[2]), {})[t] = v
            continue
        if len(tok) == 4:
            try:
                v = float(tok[3])
                if math.isfinite(v):
                    f.val[(metric, tok[2])] = v
                continue
            except ValueError:
                pass
        f.text.setdefault(metric, []).append(" ".join(tok[2:]))
    return f


def num(v, fmt="%.3g"):
    return "n/a" if v is None else fmt % v


def ratio(a, b):
    """a / b as 'N.Nx', or n/a."""
    if a is None or b is None or b <= 0:
        return "n/a"
    r = a / b
    return ("%.1fx" % r) if r >= 0.95 else ("%.2fx" % r)


def tstr(t):
    """a duration in seconds, compactly"""
    if t is None:
        return "n/a"
    return "%.3g s" % t


def k_label(s, k):
    if k is None:
        return "k=n/a"
    if s:
        r = s / k
        n = round(r)
        if n >= 2 and int(k) in (int(s) // n, -(-int(s) // n)):
            return "k=s/%d" % n
    return "k=%d" % int(k)


def configs(ours, faiss):
    seen = []
    for fig in (faiss, ours):
        for (metric, cfg) in list(fig.val) + list(fig.sweep):
            if metric in ("train_s", "mse", "search_ns_per_token", "recall", "train_s_T", "mse_T") \
                    and cfg[:1] == "m" and "b" in cfg and cfg not in seen:
                seen.append(cfg)
    known = [c for c in CONFIG_ORDER if c in seen]
    return known + sorted(c for c in seen if c not in CONFIG_ORDER)


def train_to_mse(ours, faiss, cfg):
    f_t, f_mse = faiss.get("train_s", cfg), faiss.get("mse", cfg)
    head = "train to faiss MSE  %s: faiss %s (mse %s)" % (cfg, tstr(f_t), num(f_mse, "%.4g"))
    ts = ours.sweep.get(("train_s_T", cfg), {})
    ms = ours.sweep.get(("mse_T", cfg), {})
    if f_mse is None or not ms:
        return head + "  pqcache n/a  speedup n/a"
    target = f_mse * (1.0 + MSE_TOL)
    ok = sorted(T for T, v in ms.items() if v <= target)
    if not ok:
        best = min(ms, key=lambda T: ms[T])
        return head + "  pqcache not reached (best T=%g mse %s, %s)  speedup n/a" % (
            best, num(ms[best], "%.4g"), tstr(ts.get(best)))
    T = ok[0]
    return head + "  pqcache %s (T=%g, mse %s)  speedup %s" % (
        tstr(ts.get(T)), T, num(ms[T], "%.4g"), ratio(f_t, ts.get(T)))


def same_iters(ours, faiss, cfg, iters=10):
    ts = ours.sweep.get(("train_s_T", cfg), {})
    ms = ours.sweep.get(("mse_T", cfg), {})
    o_t, o_mse, how = ts.get(float(iters)), ms.get(float(iters)), "T=%d" % iters
    if o_t is None:
        o_t, o_mse, how = ours.get("train_s", cfg), ours.get("mse", cfg), "default"
    f_t, f_mse = faiss.get("train_s", cfg), faiss.get("mse", cfg)
    return "train %d iterations %s: faiss %s (mse %s)  pqcache %s (%s, mse %s)  speedup %s" % (
        iters, cfg, tstr(f_t), num(f_mse, "%.4g"), tstr(o_t), how, num(o_mse, "%.4g"),
        ratio(f_t, o_t))


def main(argv):
    if len(argv) != 3:
        sys.stderr.write("usage: report.py OURS.txt FAISS.txt\n")
        return 2
    ours = parse(argv[1], "pqcache")
    faiss = parse(argv[2], "faiss")
    for fig, path in ((ours, argv[1]), (faiss, argv[2])):
        if fig.error:
            print("note: %s: %s (its figures show as n/a)" % (path, fig.error))

    s = faiss.get("tokens", "all") or ours.get("tokens", "all")
    k = faiss.get("k", "all") or ours.get("k", "all")
    d = faiss.get("dim", "all") or ours.get("dim", "all")
    g = faiss.get("heads", "all") or ours.get("heads", "all")
    kl = k_label(s, k)

    print("== pqcache vs faiss ==")
    print("data: s=%s d=%s g=%s %s (%s)  needles=%s" % (
        num(s, "%d"), num(d, "%d"), num(g, "%d"), kl, num(k, "%d"),
        num(faiss.get("needles", "all") or ours.get("needles", "all"), "%d")))
    for key in ("tokens", "k", "dim", "heads"):
        a, b = ours.get(key, "all"), faiss.get(key, "all")
        if a is not None and b is not None and a != b:
            print("WARNING: %s differs: pqcache %g, faiss %g (not the same dataset?)" % (key, a, b))
    print("faiss %s  simd %s  threads %s" % (
        faiss.first_text("version") or "n/a", faiss.first_text("simd") or "n/a",
        num(faiss.get("threads", "all"), "%d")))
    print("pqcache %s  simd %s  threads %s" % (
        ours.first_text("version") or "n/a", ours.first_text("simd") or "n/a",
        num(ours.get("threads", "all"), "%d")))
    print("(ratios: faiss time / pqcache time; train-to-MSE tolerance %.1f%%)" % (MSE_TOL * 100))

    cfgs = configs(ours, faiss)
    print("-- training --")
    for c in cfgs:
        print(train_to_mse(ours, faiss, c))
        print(same_iters(ours, faiss, c))
        print("encode %s: faiss %s  pqcache %s  %s" % (
            c, tstr(faiss.get("encode_s", c)), tstr(ours.get("encode_s", c)),
            ratio(faiss.get("encode_s", c), ours.get("encode_s", c))))

    print("-- search + top-k, one query, %s --" % kl)
    for c in cfgs:
        f, o = faiss.get("search_ns_per_token", c), ours.get("search_ns_per_token", c)
        print("search+topk %s %s: faiss IndexPQ %s ns/tok  pqcache %s ns/tok  %s" % (
            c, kl, num(f), num(o), ratio(f, o)))
        fs, os_ = faiss.get("scan_ns_per_token", c), ours.get("scan_ns_per_token", c)
        if fs is not None or os_ is not None:
            print("scan only %s: faiss IndexPQ k=1 %s ns/tok  pqcache %s ns/tok  %s" % (
                c, num(fs), num(os_), ratio(fs, os_)))

    approx = [(v, c) for (m, c), v in faiss.val.items()
              if m == "search_ns_per_token" and not c.startswith("exact")]
    if approx:
        best_v, best_c = min(approx)
        for c in cfgs:
            o = ours.get("search_ns_per_token", c)
            if o is None:
                continue
            print("vs faiss best (%s %s ns/tok): pqcache %s %s ns/tok  %s" % (
                best_c, num(best_v), c, num(o), ratio(best_v, o)))
    else:
        print("vs faiss best: n/a")

    print("-- the default: softmax-sum over the %s query heads of a KV head --" % num(ours.get("heads", "all")))
    for c in cfgs:
        sm, su = ours.get("search_gqa4_softmax_ns_per_token", c), ours.get("search_ns_per_token", c)
        if sm is None:
            continue
        print("softmax-sum %s%s: pqcache %s ns/tok  (summed query %s ns/tok: %s the summed query; "
              "faiss IndexPQ, one query, %s ns/tok: %s)" % (
                  c, " (the default shape)" if c == DEFAULT_CFG else "", num(sm), num(su),
                  "%.2fx" % (sm / su) if su else "n/a", num(faiss.get("search_ns_per_token", c)),
                  ratio(faiss.get("search_ns_per_token", c), sm)))

    grp = sorted((int(cfg.split("/g")[1]), v) for (metric, cfg), v in ours.val.items()
                 if metric == "softmax_group_ns_per_token" and "/g" in cfg)
    if grp:
        print("softmax-sum %s by GQA group (query heads per KV head): %s ns/tok" % (
            DEFAULT_CFG, "  ".join("g=%d %s" % (g, num(v)) for g, v in grp)))

    print("-- selection quality --")
    for c in cfgs:
        print("recall %s: faiss %s pqcache %s" % (
            c, num(faiss.get("recall", c), "%.3f"), num(ours.get("recall", c), "%.3f")))
        print("needle recall %s: faiss %s pqcache %s" % (
            c, num(faiss.get("needle_recall", c), "%.3f"),
            num(ours.get("needle_recall", c), "%.3f")))
    if faiss.get("recall", "fastscan_m16b4") is not None:
        print("recall fastscan_m16b4: faiss %s  needle %s" % (
            num(faiss.get("recall", "fastscan_m16b4"), "%.3f"),
            num(faiss.get("needle_recall", "fastscan_m16b4"), "%.3f")))

    print("-- exact selection --")
    ex = ours.get("search_ns_per_token", "exact")
    print("exact %s: faiss numpy %s ns/tok  faiss IndexFlatIP %s ns/tok  pqcache %s ns/tok  %s" % (
        kl, num(faiss.get("search_ns_per_token", "exact_numpy")),
        num(faiss.get("search_ns_per_token", "exact_flatip")), num(ex),
        ratio(faiss.get("search_ns_per_token", "exact_numpy"), ex)))
    for c in cfgs:
        o = ours.get("search_ns_per_token", c)
        if o is None and ex is None:
            continue
        print("pqcache PQ vs exact selection %s: exact %s ns/tok  PQ %s ns/tok  %s" % (
            c, num(ex), num(o), ratio(ex, o)))

    bw = ours.get("membw_gbs", "all")
    if bw:
        print("-- memory-bandwidth floor (%.3g GB/s read) --" % bw)
        for c in cfgs:
            try:
                m, b = (int(x) for x in c[1:].split("b"))
            except ValueError:
                continue
            bpt = m * b / 8.0
            floor = bpt / bw  # bytes / (GB/s) = ns
            o = ours.get("search_ns_per_token", c)
            print("floor %s: %g B/tok = %s ns/tok  pqcache %s ns/tok (%s the floor)" % (
                c, bpt, num(floor), num(o), ratio(o, floor)))
        if d:
            for name, size, v in (("fp32", 4, ex), ("fp16", 2, ours.get("search_ns_per_token", "exact_f16"))):
                floor = d * float(size) / bw
                print("floor exact %s: %d B/tok = %s ns/tok  pqcache %s ns/tok (%s the floor)" % (
                    name, int(d * size), num(floor), num(v), ratio(v, floor)))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except BrokenPipeError:  # e.g. piped into head
        sys.exit(0)
