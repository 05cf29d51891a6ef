/* bench_cache: the sequence cache at decode time and during prefill.

   1. select + fetch per layer (8 KV heads, 32 query heads, d_h 128, budget 1/10; another
      shape where the build sets BENCH_HKV, BENCH_HQ and BENCH_D) at
      several lengths, next to the PQ search alone over the same codes, and (CPU tier)
      the select + fetch of the default (re-ranking the PQ top 1.5k), of re-ranking R
      and of the adaptive split (PQC_SPLIT_ADAPTIVE: windows that do not compete)
      against the PQ top-k alone (rerank off, the window competing), each pair
      alternated;
   2. bytes moved per generated token and block-cache hit rates for no cache, LRU and LFU
      on a synthetic decode trace in which a few regions stay important;
   3. how much of the PQ build hides behind a simulated prefill whose per-layer cost grows
      quadratically (the GPU's time is slept, as a GPU would leave the CPU free), with
      the adaptive T_max scheduler choosing the iteration count.
   4. with --files: loading a saved cache (pqc_cache_load) against rebuilding it from the
      keys (prefill + the PQ builds, 10 Lloyd iterations), one layer of 8 KV heads, fp16,
      median of 3, the file in $TMPDIR (or /tmp) and in the page cache.

   usage: bench_cache [--sizes 4096,16384,65536,131072] [--threads T] [--quick]
                      [--backend cpu|cuda] [--select-only] [--files] [--fp16] [--rerank R]
                      [--alt M,BITS]
   --backend cuda puts the device tier on a CUDA GPU (select and fetch then run there,
   the fetch copying the gathered rows back to the host; part 1 adds the device fetch
   without that copy); --select-only stops after part 1; --fp16: the caches of parts 1-3
   store K and V in fp16 (as engines do; the default is fp32), the fetch converting them;
   --rerank R: the re-ranking row of part 1 takes the top R x k (default 3); --alt M,BITS:
   its last row's code shape (default 2,6, the library's first default, with 32 sinks and
   no re-ranking as it had). */
#define PQCACHE_IMPLEMENTATION
#include "../pqcache.h"
#include "../tests/synth.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"

static void sleep_s(double s)
{
    struct timespec ts;
    if (s <= 0) return;
    ts.tv_sec = (time_t)s;
    ts.tv_nsec = (long)((s - (double)ts.tv_sec) * 1e9);
    nanosleep(&ts, NULL);
}
/* the attention shape: 8 KV heads, 32 query heads, d_h 128 unless the build says otherwise
   (make bench-cache also builds bench_cache_d256: 4 KV heads, 8 query heads of 256) */
#ifndef BENCH_HKV
#define BENCH_HKV 8
#define BENCH_HQ 32
#define BENCH_D 128
#endif
enum { HKV = BENCH_HKV, HQ = BENCH_HQ, D = BENCH_D };

/* keys of 8 heads: the synthetic generator per head (different seeds), interleaved */
static float *make_kv(size_t s, uint64_t seed, float **queries, uint32_t **needles)
{
    float *kv = (float *)malloc(s * HKV * D * sizeof(float));
    int h;
    if (!kv) return NULL;
    *queries = (float *)malloc((size_t)HQ * D * sizeof(float));
    *needles = (uint32_t *)malloc(HKV * 4 * sizeof(uint32_t));
    for (h = 0; h < HKV; h++) {
        synth sy;
        size_t t;
        memset(&sy, 0, sizeof sy);
        sy.s = s;
        sy.d = D;
        sy.g = HQ / HKV;
        sy.n_needles = 4;
        sy.seed = seed * 131 + (uint64_t)h;
        if (synth_make(&sy)) return NULL;
        for (t = 0; t < s; t++) memcpy(kv + (t * HKV + h) * D, sy.keys + t * D, D * sizeof(float));
        memcpy(*queries + (size_t)h * (HQ / HKV) * D, sy.queries, (size_t)(HQ / HKV) * D * sizeof(float));
        memcpy(*needles + h * 4, sy.needles, 4 * sizeof(uint32_t));
        synth_free(&sy);
    }
    return kv;
}

/* an engine's gather buffer for K and V: n floats each, starting on a 64-byte line as
   engines' allocators give them (torch's among them); one block, freed with free(*base) */
static pqc_kv_out kv_out_alloc(size_t head_stride, size_t n, void **base)
{
    pqc_kv_out o;
    unsigned char *b = (unsigned char *)malloc(2 * n * sizeof(float) + 64);
    memset(&o, 0, sizeof o);
    *base = b;
    if (!b) return o;
    o.k = (float *)(void *)(b + (64 - (uintptr_t)b % 64));
    o.v = o.k + n;
    o.head_stride = head_stride;
    return o;
}

/* the engine's read of what a fetch gathered: every row of every head once */
static float read_rows(const pqc_kv_out *o, const pqc_selection *sel, int heads)
{
    float a[16] = {0}, sum = 0.0f;
    int h, l;
    for (h = 0; h < heads; h++) {
        const float *k = o->k + (size_t)h * o->head_stride * D, *v = o->v + (size_t)h * o->head_stride * D;
        size_t i, n = sel->count[h] * D; /* (D a multiple of 16) */
        for (i = 0; i < n; i += 16)
            for (l = 0; l < 16; l++) a[l] += k[i + (size_t)l] * v[i + (size_t)l];
    }
    for (l = 0; l < 16; l++) sum += a[l];
    return sum;
}

/* read_rows over rows handed by pointer (pqc_cache_fetch_rows), as stored: each row
   converted to fp32 as it is read, as an engine's attention over fp16 rows converts them */
static float read_rows_at(pqc_simd simd, const void *const *const *kr, const void *const *const *vr,
                          const pqc_selection *sel, int heads, pqc_dtype dt)
{
    float a[16] = {0}, kb[D], vb[D], sum = 0.0f;
    int h, l;
    for (h = 0; h < heads; h++) {
        size_t i, e;
        for (i = 0; i < sel->count[h]; i++) {
            if (i + PQC__ROWS_AHEAD < sel->count[h]) { /* scattered rows: asked for early */
                for (e = 0; e < D * pqc_dtype_size(dt); e += 64) {
                    PQC__PREFETCH((const char *)kr[h][i + PQC__ROWS_AHEAD] + e);
                    PQC__PREFETCH((const char *)vr[h][i + PQC__ROWS_AHEAD] + e);
                }
            }
            pqc__k_to_f32(simd, kr[h][i], dt, D, kb);
            pqc__k_to_f32(simd, vr[h][i], dt, D, vb);
            for (e = 0; e < D; e += 16)
                for (l = 0; l < 16; l++) a[l] += kb[e + (size_t)l] * vb[e + (size_t)l];
        }
    }
    for (l = 0; l < 16; l++) sum += a[l];
    return sum;
}

static pqc_dtype g_kv_dtype = PQC_F32; /* the storage of parts 1-3 (--fp16) */

/* m = bits = 0: the library's default codebook shape */
static pqc_cache_desc desc_for(size_t s, int m, int bits)
{
    pqc_cache_desc cd;
    memset(&cd, 0, sizeof cd);
    cd.n_layers = 1;
    cd.n_kv_heads = HKV;
    cd.n_q_heads = HQ;
    cd.head_dim = D;
    cd.max_tokens = s + 4096;
    cd.budget_ratio = 0.1;
    cd.kv_dtype = g_kv_dtype;
    cd.pq.m = m;
    cd.pq.bits = bits;
    cd.pq.iters = 4;
    cd.pq.seed = 7;
    return cd;
}

/* a one-layer cache holding the s keys of kv (also as values), built and ready */
static pqc_cache *open_cache(pqc_runtime *rt, const pqc_cache_desc *cd, const float *kv, size_t s, pqc_selection *sel)
{
    pqc_cache *c;
    pqc_matrix km;
    km.data = kv;
    km.dtype = PQC_F32;
    km.rows = s;
    km.cols = HKV * D;
    km.row_stride = 0;
    if (pqc_cache_create(rt, cd, &c) || pqc_cache_prefill(c, 0, &km, &km) || pqc_cache_sync(c) ||
        pqc_selection_init(c, sel)) {
        fprintf(stderr, "bench_cache: %s\n", pqc_last_error());
        exit(1);
    }
    return c;
}

static void bench_select_fetch(pqc_runtime *rt, size_t s, int m, int bits, double rerank, int n_sink)
{
    pqc_cache_desc cd = desc_for(s, m, bits), rc;
    char shape[96], rr[32];
    pqc_cache *c;
    pqc_selection sel;
    pqc_kv_out out;
    void *outmem;
    float *q, *kv, sink = 0.0f;
    uint32_t *needles, *idx;
    double ts[15], tf[15], tr[15], tp[15], td[15], tw[15], te[15], tq[15], tx[15], step_waits = 0.0, step_bytes = 0.0;
    int r, h, found = 0, gpu = pqc_runtime_backend(rt) == PQC_BACKEND_CUDA;
    kv = make_kv(s, 3, &q, &needles);
    if (!kv) return;
    cd.rerank = rerank;
    cd.n_sink = n_sink;
    c = open_cache(rt, &cd, kv, s, &sel);
    pqc_cache_config(c, &rc);
    rr[0] = 0;
    if (rc.rerank > 0) snprintf(rr, sizeof rr, " rerank %g", rc.rerank);
    snprintf(shape, sizeof shape, "%s m%db%d%s", m ? "      " : "default", rc.pq.m, rc.pq.bits, rr);
    out = kv_out_alloc(s, HKV * s * D, &outmem);
    idx = (uint32_t *)malloc(s * sizeof(uint32_t));
    for (r = 0; r < 15; r++) {
        double t0 = now(), t1, t2;
        pqc_cache_select(c, 0, q, &sel);
        t1 = now();
        pqc_cache_fetch(c, 0, &sel, &out);
        t2 = now();
        ts[r] = t1 - t0;
        tf[r] = t2 - t1;
        sink += read_rows(&out, &sel, HKV); /* the engine's read of the rows, as attention reads them */
        tr[r] = now() - t2;
        if (gpu) { /* the device fetch alone: select again, fetch without the copy home, and
                      the next select's wait for the stream covers the gather */
            pqc_kv_device dk;
            double t3;
            pqc_cache_select(c, 0, q, &sel);
            t2 = now();
            pqc_cache_fetch_device(c, 0, &sel, &dk);
            t3 = now();
            td[r] = t3 - t2;
        }
    }
    if (gpu) { /* the whole step on the device: two steps of the layer enqueued back to back,
                  then one wait (a decode visits a layer once per step, and the engine waits
                  for its logits once per step; the library's staging is two steps deep),
                  four times over; and the host's time to enqueue one */
        pqc_kv_device dk;
        pqc_layer_stats st;
        size_t cnt[HKV];
        uint64_t w0, b0;
        pqc_cache_stats(c, 0, &st);
        w0 = st.device_waits;
        b0 = st.bytes_h2d;
        for (r = 0; r < 15; r++) {
            double t0 = now(), t1;
            int l;
            t1 = 0.0;
            for (l = 0; l < 8; l++) {
                double e0 = now();
                pqc_cache_step_device(c, 0, q, &dk, cnt);
                t1 += now() - e0;
                if (l % 2 == 1) pqc_cache_stats(c, 0, &st); /* waits for the stream */
            }
            tw[r] = (now() - t0) / 8;
            te[r] = t1 / 8;
        }
        step_waits = (double)(st.device_waits - w0) / (15.0 * 8.0);
        step_bytes = (double)(st.bytes_h2d - b0) / (15.0 * 8.0);
    }
    for (h = 0; h < HKV; h++) {
        int i;
        for (i = 0; i < 4; i++) found += pqc_recall(needles + h * 4 + i, 1, sel.idx + (size_t)h * sel.capacity, sel.count[h]) > 0;
    }
    if (gpu) {
        double ms = median(ts, 15) * 1e3, mf = median(tf, 15) * 1e3, md = median(td, 15) * 1e3;
        pqc_layer_stats st;
        pqc_cache_stats(c, 0, &st);
        printf("cuda select+fetch s=%-7zu %s select %.3f ms  fetch %.3f ms (rows to the host)  fetch_device %.3f ms "
               "(enqueue)  total %.3f ms  needles %d/%d  selected/head %zu  hit rate %.1f%%\n",
               s, shape, ms, mf, md, ms + mf, found, 4 * HKV, sel.count[0],
               st.hits + st.misses ? 100.0 * (double)st.hits / (double)(st.hits + st.misses) : 0.0);
        printf("cuda device step s=%-7zu %s %.1f us per layer step (select, admission and gather on the device, one "
               "wait per 2 steps)  host enqueue %.1f us  library waits per step %.2f  bytes up per step %.0f\n",
               s, shape, median(tw, 15) * 1e6, median(te, 15) * 1e6, step_waits, step_bytes);
    } else { /* the PQ search alone: the same codes, the same k, the 8 heads one after another */
        pqc__layer *L = &c->layers[0];
        size_t mid = s - 32, budget = (size_t)ceil(0.1 * (double)mid), k = budget - (size_t)pqc_cache_layer_window(c, 0);
        pqc_search_desc sd;
        memset(&sd, 0, sizeof sd);
        sd.k = k;
        sd.count = L->n_coded;
        for (r = 0; r < 15; r++) {
            double t0 = now();
            for (h = 0; h < HKV; h++)
                pqc_pq_search(rt, &L->heads[h].pq, &L->heads[h].codes, q + (size_t)h * (HQ / HKV) * D, HQ / HKV, &sd,
                              &L->heads[h].scratch, idx, NULL);
            tp[r] = now() - t0;
        }
        for (r = 0; r < 15; r++) { /* the rows by pointer, as stored, read where they lie */
            const void *const *const *kr;
            const void *const *const *vr;
            double t1, t2;
            pqc_cache_select(c, 0, q, &sel);
            t1 = now();
            pqc_cache_fetch_rows(c, 0, &sel, &kr, &vr);
            t2 = now();
            sink += read_rows_at(pqc__simd(rt), kr, vr, &sel, HKV, rc.kv_dtype);
            tq[r] = t2 - t1;
            tx[r] = now() - t2;
        }
    }
    if (!gpu) {
        double ms = median(ts, 15) * 1e3, mf = median(tf, 15) * 1e3, mp = median(tp, 15) * 1e3;
        printf("select+fetch s=%-7zu %s select %.3f ms  fetch %.3f ms  total %.3f ms = %.2f ns per token and KV head | "
               "PQ search alone %.3f ms (serial) | (select+fetch)/search %.2fx  needles %d/%d  selected/head %zu | "
               "then the engine's read of the rows %.3f ms | rows by pointer (fetch_rows) %.3f ms, read as stored %.3f "
               "ms%s\n",
               s, shape, ms, mf, ms + mf, (ms + mf) * 1e6 / ((double)s * HKV), mp, (ms + mf) / mp, found, 4 * HKV, sel.count[0],
               median(tr, 15) * 1e3, median(tq, 15) * 1e3, median(tx, 15) * 1e3, sink == 1.0f ? " " : "");
    }
    fflush(stdout);
    free(outmem);
    free(idx);
    pqc_selection_free(&sel);
    pqc_cache_destroy(c);
    free(kv);
    free(q);
    free(needles);
}

/* re-ranking's cost (`rerank`: 0 the default's 1.5; or the adaptive split's, whose
   windows do not compete: split = PQC_SPLIT_ADAPTIVE) against the PQ top-k alone
   (rerank off, the window competing), alternated: two caches over the same keys, select
   + fetch on each in turn, 15 pairs; the median of the pairs' ratios. This machine's speed can move by a
   fifth within a minute, so a ratio of two rows measured apart says little. With
   `against_adaptive` the reference is the default's re-ranking under the adaptive split
   instead (the window's rivals neither scored nor chosen): the competing window's own
   cost. */
static void bench_rerank_pair(pqc_runtime *rt, size_t s, double rerank, pqc_split split, int against_adaptive)
{
    pqc_cache_desc cd = desc_for(s, 0, 0);
    char what[48];
    pqc_cache *c[2];
    pqc_selection sel[2];
    pqc_kv_out out;
    void *outmem;
    float *q, *kv;
    uint32_t *needles;
    double t[2][15], ratio[15], lo = 1e300, hi = 0.0;
    int r, w;
    kv = make_kv(s, 3, &q, &needles);
    if (!kv) return;
    cd.rerank = against_adaptive ? 0 : -1;
    cd.split = against_adaptive ? PQC_SPLIT_ADAPTIVE : PQC_SPLIT_COMPETE;
    c[0] = open_cache(rt, &cd, kv, s, &sel[0]);
    cd.rerank = rerank;
    cd.split = split;
    c[1] = open_cache(rt, &cd, kv, s, &sel[1]);
    if (split == PQC_SPLIT_ADAPTIVE) snprintf(what, sizeof what, "the adaptive split");
    else if (rerank == 0) snprintf(what, sizeof what, "the default (rerank %g)", PQC_DEFAULT_RERANK);
    else snprintf(what, sizeof what, "rerank %g", rerank);
    out = kv_out_alloc(s, HKV * s * D, &outmem);
    for (w = 0; w < 2; w++) { /* first calls: scratch and the output's pages */
        pqc_cache_select(c[w], 0, q, &sel[w]);
        pqc_cache_fetch(c[w], 0, &sel[w], &out);
    }
    for (r = 0; r < 15; r++) {
        for (w = 0; w < 2; w++) {
            int x = (r & 1) ? 1 - w : w; /* which goes first alternates too */
            double t0 = now();
            pqc_cache_select(c[x], 0, q, &sel[x]);
            pqc_cache_fetch(c[x], 0, &sel[x], &out);
            t[x][r] = now() - t0;
        }
        ratio[r] = t[1][r] / t[0][r];
        if (ratio[r] < lo) lo = ratio[r];
        if (ratio[r] > hi) hi = ratio[r];
    }
    printf("select+fetch s=%-7zu %s against %s, alternated: ratio %.2fx (median of 15 pairs; "
           "%.2f-%.2f)  %s %.3f ms  %s %.3f ms\n",
           s, what, against_adaptive ? "it under the adaptive split" : "the PQ top-k alone", median(ratio, 15), lo, hi,
           against_adaptive ? "adaptive" : "PQ top-k", median(t[0], 15) * 1e3, what, median(t[1], 15) * 1e3);
    fflush(stdout);
    free(outmem);
    for (w = 0; w < 2; w++) {
        pqc_selection_free(&sel[w]);
        pqc_cache_destroy(c[w]);
    }
    free(kv);
    free(q);
    free(needles);
}

/* decode trace: queries that keep returning to a few important regions */
static void bench_trace(pqc_runtime *rt, size_t s, int steps)
{
    static const char *names[] = {"no cache", "LRU", "LFU"};
    int mode;
    float *q, *kv, *newkv;
    uint32_t *needles;
    uint64_t st = 5;
    kv = make_kv(s, 9, &q, &needles);
    if (!kv) return;
    newkv = (float *)malloc(HKV * D * sizeof(float));
    for (mode = 0; mode < 3; mode++) {
        pqc_cache_desc cd = desc_for(s, 2, 6);
        pqc_cache *c;
        pqc_selection sel;
        pqc_kv_out out;
        pqc_layer_stats lst;
        float *qq = (float *)malloc((size_t)HQ * D * sizeof(float));
        int step, i;
        size_t dev, full;
        double full_step_bytes;
        memset(&lst, 0, sizeof lst);
        cd.cache_blocks = mode == 0 ? -1 : 64;
        cd.policy = mode == 1 ? PQC_POLICY_LRU : PQC_POLICY_LFU;
        c = open_cache(rt, &cd, kv, s, &sel);
        out.head_stride = s + (size_t)steps;
        out.k = (float *)malloc(HKV * out.head_stride * D * sizeof(float));
        out.v = (float *)malloc(HKV * out.head_stride * D * sizeof(float));
        for (step = 0; step < steps; step++) {
            /* the needle direction plus drifting noise: the important tokens persist */
            for (i = 0; i < HQ * D; i++) qq[i] = q[i] + 0.6f * synth__normal(&st);
            for (i = 0; i < HKV * D; i++) newkv[i] = synth__normal(&st);
            pqc_cache_append(c, 0, newkv, newkv);
            pqc_cache_select(c, 0, qq, &sel);
            pqc_cache_fetch(c, 0, &sel, &out);
        }
        pqc_cache_stats(c, 0, &lst);
        pqc_cache_memory(c, &dev, &full);
        full_step_bytes = (double)full; /* moving the whole K and V of the sequence */
        printf("trace s=%zu %-8s hit rate %5.1f%%  bytes/token %.3f MB (codes %.3f MB, misses+admissions %.3f MB)  "
               "whole K+V %.1f MB  -> %.1fx fewer\n",
               s, names[mode], lst.hits + lst.misses ? 100.0 * (double)lst.hits / (double)(lst.hits + lst.misses) : 0.0,
               (double)lst.bytes_h2d / steps / 1e6, (double)lst.bytes_codes / steps / 1e6,
               (double)(lst.bytes_h2d - lst.bytes_codes) / steps / 1e6, full_step_bytes / 1e6,
               full_step_bytes / ((double)lst.bytes_h2d / steps));
        fflush(stdout);
        free(out.k);
        free(out.v);
        free(qq);
        pqc_selection_free(&sel);
        pqc_cache_destroy(c);
    }
    free(newkv);
    free(kv);
    free(q);
    free(needles);
}

/* simulated per-layer prefill compute of the GPU: a2 + b2 s + g2 s^2 seconds */
static const double A2 = 2e-3, B2 = 1.5e-6, G2 = 4e-11;
static double sim_compute(size_t s) { return A2 + B2 * (double)s + G2 * (double)s * (double)s; }

static void bench_overlap(pqc_runtime *rt, size_t s, int layers, pqc_scheduler *sch)
{
    pqc_cache_desc cd = desc_for(s, 2, 6);
    pqc_cache *c;
    pqc_selection sel;
    float *q, *kv;
    uint32_t *needles;
    pqc_matrix km;
    int l;
    double t0, wait = 0, build = 0, compute = 0, offload = 0;
    int iters = 0;
    kv = make_kv(s, 11, &q, &needles);
    if (!kv) return;
    cd.n_layers = layers;
    cd.pq.iters = 0; /* adaptive */
    cd.scheduler = sch;
    km.data = kv;
    km.dtype = PQC_F32;
    km.rows = s;
    km.cols = HKV * D;
    km.row_stride = 0;
    if (pqc_cache_create(rt, &cd, &c) || pqc_selection_init(c, &sel)) exit(1);
    t0 = now();
    for (l = 0; l < layers; l++) { /* Algorithm 1: offload layer l, build it while layer l+1 computes */
        double tc = sim_compute(s), t1 = now();
        pqc_cache_prefill(c, l, &km, &km); /* host side: store K/V, queue the build */
        offload += now() - t1;
        sleep_s(tc);
        compute += tc;
        pqc_cache_report_compute(c, l, (double)s, tc);
    }
    for (l = 0; l < layers; l++) { /* the first decode step: each layer's select waits for its build */
        pqc_layer_stats st;
        memset(&st, 0, sizeof st);
        sleep_s(2e-4); /* a decode layer's compute */
        pqc_cache_select(c, l, q, &sel);
        pqc_cache_stats(c, l, &st);
        wait += st.wait_s;
        build += st.build_s;
        iters = st.last_iters;
    }
    printf("overlap s=%-7zu layers %d  T=%-3d  GPU prefill (simulated) %.3f s  host offload %.3f s  build work %.3f s "
           "(worker time)  waited at first selects %.4f s  -> %.1f%% of the build hidden  wall %.3f s\n",
           s, layers, iters, compute, offload, build, wait, build > 0 ? 100.0 * (1.0 - wait / build) : 100.0, now() - t0);
    fflush(stdout);
    pqc_selection_free(&sel);
    pqc_cache_destroy(c);
    free(kv);
    free(q);
    free(needles);
}

/* part 4: save / load against rebuilding, one layer */
static void bench_files(pqc_runtime *rt, size_t s)
{
    pqc_cache_desc cd;
    float *q, *kv = NULL;
    uint32_t *nd;
    double tr[3], ts[3], tl[3];
    char path[600];
    const char *dir = getenv("TMPDIR") && getenv("TMPDIR")[0] ? getenv("TMPDIR") : "/tmp";
    long bytes = 0;
    int r;
    FILE *f;
    snprintf(path, sizeof path, "%s/bench_cache_%zu.pqc", dir, s);
    memset(&cd, 0, sizeof cd);
    cd.n_layers = 1;
    cd.n_kv_heads = HKV;
    cd.n_q_heads = HQ;
    cd.head_dim = D;
    cd.kv_dtype = PQC_F16;
    cd.max_tokens = s + 64;
    cd.pq.m = 2;
    cd.pq.bits = 6;
    cd.pq.iters = 10;
    cd.pq.seed = 1;
    kv = make_kv(s, 7, &q, &nd);
    for (r = 0; r < 3; r++) {
        pqc_cache *c, *b;
        pqc_matrix m = pqc_matrix_f32(kv, s, (size_t)HKV * D);
        double t0 = now();
        if (pqc_cache_create(rt, &cd, &c) || pqc_cache_prefill(c, 0, &m, &m) || pqc_cache_sync(c)) {
            fprintf(stderr, "bench_cache: files: %s\n", pqc_last_error());
            exit(1);
        }
        tr[r] = now() - t0;
        t0 = now();
        if (pqc_cache_save(c, path)) {
            fprintf(stderr, "bench_cache: save: %s\n", pqc_last_error());
            exit(1);
        }
        ts[r] = now() - t0;
        t0 = now();
        if (pqc_cache_load(rt, &cd, path, &b)) {
            fprintf(stderr, "bench_cache: load: %s\n", pqc_last_error());
            exit(1);
        }
        tl[r] = now() - t0;
        pqc_cache_destroy(b);
        pqc_cache_destroy(c);
    }
    if ((f = fopen(path, "rb"))) {
        fseek(f, 0, SEEK_END);
        bytes = ftell(f);
        fclose(f);
    }
    remove(path);
    printf("files  s=%-7zu rebuild %8.3f s  save %7.3f s  load %7.3f s  (%.1fx faster than rebuilding)  file %.1f MB\n", s,
           median(tr, 3), median(ts, 3), median(tl, 3), median(tr, 3) / median(tl, 3), (double)bytes / 1e6);
    fflush(stdout);
    free(kv);
    free(q);
    free(nd);
}

int main(int argc, char **argv)
{
    size_t sizes[8] = {4096, 16384, 65536, 131072};
    int ns = 4, threads = 2, quick = 0, i, backend = PQC_BACKEND_CPU, select_only = 0, files = 0;
    int alt_m = 2, alt_bits = 6;
    double rerank = 3.0;
    pqc_runtime_desc rd;
    pqc_runtime *rt;
    pqc_scheduler *sch;
    pqc_scheduler_desc sd;
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--quick")) quick = 1;
        else if (!strcmp(argv[i], "--select-only")) select_only = 1;
        else if (!strcmp(argv[i], "--fp16")) g_kv_dtype = PQC_F16;
        else if (!strcmp(argv[i], "--files")) files = 1;
        else if (!strcmp(argv[i], "--rerank") && i + 1 < argc) rerank = atof(argv[++i]);
        else if (!strcmp(argv[i], "--alt") && i + 1 < argc) {
            if (sscanf(argv[++i], "%d,%d", &alt_m, &alt_bits) != 2 || alt_m < 1 || alt_bits < 1) {
                fprintf(stderr, "bench_cache: --alt M,BITS (for example 4,8)\n");
                return 2;
            }
        }
        else if (!strcmp(argv[i], "--backend") && i + 1 < argc) {
            const char *b = argv[++i];
            if (!strcmp(b, "cpu")) backend = PQC_BACKEND_CPU;
            else if (!strcmp(b, "cuda")) backend = PQC_BACKEND_CUDA;
            else {
                fprintf(stderr, "bench_cache: backend %s (cpu or cuda)\n", b);
                return 2;
            }
        }
        else if (!strcmp(argv[i], "--sizes") && i + 1 < argc) {
            char *p = argv[++i];
            ns = 0;
            while (*p && ns < 8) {
                sizes[ns++] = (size_t)strtoull(p, &p, 10);
                if (*p == ',') p++;
            }
        } else {
            fprintf(stderr, "usage: %s [--sizes a,b,c] [--threads T] [--quick] [--backend cpu|cuda] [--select-only] [--files] [--fp16] [--rerank R] [--alt M,BITS]\n",
                    argv[0]);
            return 2;
        }
    }
    memset(&rd, 0, sizeof rd);
    rd.n_threads = threads > 1 ? threads - 1 : -1;
    rd.backend = backend;
    if (pqc_runtime_create(&rd, &rt)) {
        fprintf(stderr, "bench_cache: %s\n", pqc_last_error());
        return 1;
    }
    if (pqc_runtime_backend_note(rt)[0]) printf("# %s\n", pqc_runtime_backend_note(rt));
    printf("# pqcache %s, simd %s, %d thread(s); %d KV heads, %d query heads, d_h %d, budget 1/10; select+fetch for "
           "the default codebooks and for m=%d b=%d (the other parts: m=2 b=6)\n",
           pqc_version(), pqc_simd_name(pqc_runtime_simd(rt)), threads, HKV, HQ, D, alt_m, alt_bits);
    if (files) {
        for (i = 0; i < ns; i++) bench_files(rt, sizes[i]);
        pqc_runtime_destroy(rt);
        return 0;
    }
    for (i = 0; i < ns; i++) {
        bench_select_fetch(rt, sizes[i], 0, 0, 0, 0);
        bench_select_fetch(rt, sizes[i], 0, 0, rerank, 0); /* 3: the refinement that meets the suite's targets */
        bench_select_fetch(rt, sizes[i], alt_m, alt_bits, -1, 32); /* the first default: 32 sinks, no re-ranking */
        if (backend == PQC_BACKEND_CPU) {
            bench_rerank_pair(rt, sizes[i], 0.0, PQC_SPLIT_COMPETE, 0);
            bench_rerank_pair(rt, sizes[i], 0.0, PQC_SPLIT_COMPETE, 1);
            bench_rerank_pair(rt, sizes[i], rerank, PQC_SPLIT_COMPETE, 0);
            bench_rerank_pair(rt, sizes[i], -1.0, PQC_SPLIT_ADAPTIVE, 0);
        }
    }
    if (select_only) {
        pqc_runtime_destroy(rt);
        return 0;
    }
    bench_trace(rt, quick ? 16384 : 32768, quick ? 64 : 256);
    /* scheduler: calibrate k-means on two sizes, then run the overlap at each length */
    memset(&sd, 0, sizeof sd);
    sd.t_min = 1;
    sd.parallel = threads;
    pqc_scheduler_create(&sd, &sch);
    {
        size_t cal[2] = {2048, 8192};
        int T[2] = {2, 6}, a, b;
        float *q, *kv;
        uint32_t *nd;
        kv = make_kv(8192, 1, &q, &nd);
        for (a = 0; a < 2; a++)
            for (b = 0; b < 2; b++) {
                pqc_pq pq;
                pqc_pq_desc pd;
                pqc_matrix m;
                double t0;
                memset(&pd, 0, sizeof pd);
                pd.m = 2;
                pd.bits = 6;
                pd.iters = T[b];
                m.data = kv;
                m.dtype = PQC_F32;
                m.rows = cal[a];
                m.cols = D;
                m.row_stride = HKV * D * sizeof(float);
                t0 = now();
                pqc_pq_train(NULL, &pd, &m, &pq);
                pqc_scheduler_add_kmeans(sch, (double)cal[a], T[b], now() - t0);
                pqc_pq_free(&pq);
            }
        for (a = 1; a <= 4; a++) pqc_scheduler_add_compute(sch, 4096.0 * a * a, sim_compute(4096 * (size_t)a * a));
        free(kv);
        free(q);
        free(nd);
        {
            pqc_scheduler_fit f = pqc_scheduler_get_fit(sch);
            printf("# scheduler fit: kmeans %.3g + %.3g*s*T s; compute %.3g + %.3g*s + %.3g*s^2 s (simulated GPU: "
                   "%.3g + %.3g*s + %.3g*s^2)\n",
                   f.a1, f.b1, f.a2, f.b2, f.g2, A2, B2, G2);
        }
    }
    for (i = 0; i < ns; i++)
        if (!quick || sizes[i] <= 65536) bench_overlap(rt, sizes[i], 4, sch);
    pqc_scheduler_destroy(sch);
    pqc_runtime_destroy(rt);
    return 0;
}
