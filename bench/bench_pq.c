/* bench_pq: pqcache's PQ training, encoding and search on synthetic LLM-like keys.

   Writes the dataset it measured (so faiss can be run on the very same keys) and prints
   `pqcache <metric> <config> <value>` lines for bench/report.py.

   usage: bench_pq [--s N] [--threads T] [--reps R] [--data FILE] [--configs m2b8,m4b8,m16b4]
                   [--quick] */
#define PQCACHE_IMPLEMENTATION
#include "../pqcache.h"
#include "../tests/synth.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"


static int write_data(const char *path, const synth *sy, uint32_t k)
{
    FILE *f = fopen(path, "wb");
    uint32_t hdr[7];
    if (!f) return -1;
    hdr[0] = 1;
    hdr[1] = (uint32_t)sy->s;
    hdr[2] = (uint32_t)sy->d;
    hdr[3] = (uint32_t)sy->g;
    hdr[4] = k;
    hdr[5] = (uint32_t)sy->n_needles;
    hdr[6] = 0;
    fwrite("PQCB", 1, 4, f);
    fwrite(hdr, 4, 7, f);
    fwrite(sy->keys, sizeof(float), sy->s * (size_t)sy->d, f);
    fwrite(sy->queries, sizeof(float), (size_t)sy->g * sy->d, f);
    fwrite(sy->needles, sizeof(uint32_t), (size_t)sy->n_needles, f);
    return fclose(f);
}

/* single-core streaming read bandwidth, GB/s */
static double membw(void)
{
    size_t n = (size_t)64 << 20, i;
    float *a = (float *)malloc(n * sizeof(float));
    double best = 0;
    int r;
    volatile float sink;
    if (!a) return 0;
    for (i = 0; i < n; i++) a[i] = (float)(i & 7);
    for (r = 0; r < 3; r++) {
        float acc[8] = {0};
        double t = now(), dt;
        for (i = 0; i < n; i += 8) {
            acc[0] += a[i];
            acc[1] += a[i + 1];
            acc[2] += a[i + 2];
            acc[3] += a[i + 3];
            acc[4] += a[i + 4];
            acc[5] += a[i + 5];
            acc[6] += a[i + 6];
            acc[7] += a[i + 7];
        }
        dt = now() - t;
        sink = acc[0] + acc[1] + acc[2] + acc[3] + acc[4] + acc[5] + acc[6] + acc[7];
        (void)sink;
        if (n * 4.0 / dt / 1e9 > best) best = n * 4.0 / dt / 1e9;
    }
    free(a);
    return best;
}

int main(int argc, char **argv)
{
    size_t s = 32768;
    int threads = 1, reps = 3, quick = 0, i, ci;
    const char *data = NULL, *configs = "m2b8,m4b8,m16b4";
    synth sy;
    pqc_runtime_desc rd;
    pqc_runtime *rt;
    pqc_matrix keys;
    pqc_search_desc sd;
    pqc_scratch scr;
    float *qsum;
    uint32_t *exact_idx, *idx;
    size_t k;
    static const int sweep[] = {1, 2, 3, 4, 5, 6, 8, 10, 15};
    static const int cfg_m[] = {2, 4, 16}, cfg_b[] = {8, 8, 4};
    static const char *cfg_name[] = {"m2b8", "m4b8", "m16b4"};
    double tt[32];

    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--s") && i + 1 < argc) s = (size_t)strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--data") && i + 1 < argc) data = argv[++i];
        else if (!strcmp(argv[i], "--configs") && i + 1 < argc) configs = argv[++i];
        else if (!strcmp(argv[i], "--quick")) quick = 1;
        else {
            fprintf(stderr, "usage: %s [--s N] [--threads T] [--reps R] [--data FILE] [--configs LIST] [--quick]\n", argv[0]);
            return 2;
        }
    }
    if (reps < 1 || reps > 31 || s < 1000 || threads < 1) {
        fprintf(stderr, "bench_pq: bad arguments\n");
        return 2;
    }
    memset(&sy, 0, sizeof sy);
    sy.s = s;
    sy.d = 128;
    sy.g = 4;
    sy.n_needles = 8;
    sy.seed = 2025;
    if (synth_make(&sy)) {
        fprintf(stderr, "bench_pq: out of memory\n");
        return 1;
    }
    k = (s + 9) / 10;
    if (data && write_data(data, &sy, (uint32_t)k)) {
        fprintf(stderr, "bench_pq: cannot write %s\n", data);
        return 1;
    }
    memset(&rd, 0, sizeof rd);
    rd.n_threads = threads > 1 ? threads - 1 : -1; /* the caller is one of the threads */
    if (pqc_runtime_create(&rd, &rt) != PQC_SUCCESS) {
        fprintf(stderr, "bench_pq: %s\n", pqc_last_error());
        return 1;
    }
    keys.data = sy.keys;
    keys.dtype = PQC_F32;
    keys.rows = s;
    keys.cols = 128;
    keys.row_stride = 0;
    memset(&scr, 0, sizeof scr);
    memset(&sd, 0, sizeof sd);
    sd.k = k;
    sd.gqa = PQC_GQA_SUM;
    /* the faiss comparison searches one query: the sum of the g heads */
    qsum = (float *)calloc(128, sizeof(float));
    exact_idx = (uint32_t *)malloc(k * sizeof(uint32_t));
    idx = (uint32_t *)malloc(k * sizeof(uint32_t));
    for (i = 0; i < sy.g * 128; i++) qsum[i % 128] += sy.queries[i];

    printf("pqcache version %s\n", pqc_version());
    printf("pqcache simd %s\n", pqc_simd_name(pqc_runtime_simd(rt)));
    printf("pqcache tokens all %zu\npqcache k all %zu\npqcache dim all 128\npqcache heads all %d\n", s, k, sy.g);
    printf("pqcache needles all %d\npqcache threads all %d\n", sy.n_needles, threads);
    printf("pqcache membw_gbs all %.2f\n", membw());
    fflush(stdout);

    /* exact selection: true scores of the summed query + top-k */
    for (i = 0; i < reps * 3; i++) {
        double t = now();
        pqc_exact_search(rt, &keys, qsum, 1, &sd, &scr, exact_idx, NULL);
        tt[i] = now() - t;
    }
    printf("pqcache search_ns_per_token exact %.3f\n", median(tt, reps * 3) * 1e9 / (double)s);
    printf("pqcache needle_recall exact %.3f\n", pqc_recall(sy.needles, (size_t)sy.n_needles, exact_idx, k));
    { /* the same keys in fp16, as an engine holds them */
        uint16_t *h16 = (uint16_t *)malloc(s * 128 * sizeof(uint16_t));
        pqc_matrix k16 = keys;
        size_t e;
        if (!h16) return 1;
        for (e = 0; e < s * 128; e++) h16[e] = pqc_f32_to_f16(sy.keys[e]);
        k16.data = h16;
        k16.dtype = PQC_F16;
        for (i = 0; i < reps * 3; i++) {
            double t = now();
            pqc_exact_search(rt, &k16, qsum, 1, &sd, &scr, idx, NULL);
            tt[i] = now() - t;
        }
        printf("pqcache search_ns_per_token exact_f16 %.3f\n", median(tt, reps * 3) * 1e9 / (double)s);
        free(h16);
    }

    for (ci = 0; ci < 3; ci++) {
        pqc_pq pq;
        pqc_codes codes;
        pqc_pq_desc d;
        double mse = 0, t;
        int si;
        if (!strstr(configs, cfg_name[ci])) continue;
        memset(&d, 0, sizeof d);
        d.m = cfg_m[ci];
        d.bits = cfg_b[ci];
        d.seed = 1;
        /* training sweep over the iteration count */
        for (si = 0; si < (int)(sizeof sweep / sizeof sweep[0]); si++) {
            int r;
            if (quick && sweep[si] > 4 && sweep[si] != 10) continue;
            d.iters = sweep[si];
            for (r = 0; r < reps; r++) {
                t = now();
                if (pqc_pq_train(rt, &d, &keys, &pq) != PQC_SUCCESS) {
                    fprintf(stderr, "bench_pq: %s\n", pqc_last_error());
                    return 1;
                }
                tt[r] = now() - t;
                if (r + 1 < reps) pqc_pq_free(&pq);
            }
            pqc_pq_mse(rt, &pq, &keys, &mse);
            printf("pqcache train_s_T %s %d %.5f\n", cfg_name[ci], sweep[si], median(tt, reps));
            printf("pqcache mse_T %s %d %.4f\n", cfg_name[ci], sweep[si], mse);
            if (sweep[si] == 10) {
                printf("pqcache train_s %s %.5f\npqcache mse %s %.4f\n", cfg_name[ci], median(tt, reps), cfg_name[ci], mse);
            }
            fflush(stdout);
            if (sweep[si] != 10) pqc_pq_free(&pq);
            else break;
        }
        /* the T = 10 codebook is kept for encoding and search */
        for (i = 0; i < reps; i++) {
            pqc_codes_init(&codes, &pq, s, NULL);
            t = now();
            pqc_pq_encode(rt, &pq, &keys, &codes);
            tt[i] = now() - t;
            if (i + 1 < reps) pqc_codes_free(&codes);
        }
        printf("pqcache encode_s %s %.5f\n", cfg_name[ci], median(tt, reps));
        printf("pqcache codes_bytes %s %zu\n", cfg_name[ci], pqc_codes_bytes(&codes));
        for (i = 0; i < reps * 5; i++) {
            t = now();
            pqc_pq_search(rt, &pq, &codes, qsum, 1, &sd, &scr, idx, NULL);
            tt[i] = now() - t;
        }
        printf("pqcache search_ns_per_token %s %.3f\n", cfg_name[ci], median(tt, reps * 5) * 1e9 / (double)s);
        printf("pqcache recall %s %.4f\n", cfg_name[ci], pqc_recall(exact_idx, k, idx, k));
        printf("pqcache needle_recall %s %.3f\n", cfg_name[ci], pqc_recall(sy.needles, (size_t)sy.n_needles, idx, k));
        {
            pqc_search_desc s1 = sd;
            s1.k = 1;
            for (i = 0; i < reps * 5; i++) {
                t = now();
                pqc_pq_search(rt, &pq, &codes, qsum, 1, &s1, &scr, idx, NULL);
                tt[i] = now() - t;
            }
            printf("pqcache scan_ns_per_token %s %.3f\n", cfg_name[ci], median(tt, reps * 5) * 1e9 / (double)s);
            /* all 4 query heads with the authors' softmax-sum combination */
            s1 = sd;
            s1.gqa = PQC_GQA_SOFTMAX_SUM;
            for (i = 0; i < reps * 5; i++) {
                t = now();
                pqc_pq_search(rt, &pq, &codes, sy.queries, sy.g, &s1, &scr, idx, NULL);
                tt[i] = now() - t;
            }
            printf("pqcache search_gqa4_softmax_ns_per_token %s %.3f\n", cfg_name[ci],
                   median(tt, reps * 5) * 1e9 / (double)s);
            if (ci == 1) { /* the default shape under other GQA groups: g query heads (the
                              synthetic four, then scaled copies of them) */
                static const int groups[] = {1, 2, 3, 7, 8};
                float *qg = (float *)malloc(8 * 128 * sizeof(float));
                size_t gi, e;
                for (e = 0; qg && e < 8 * 128; e++)
                    qg[e] = sy.queries[(e / 128 % 4) * 128 + e % 128] * (1.0f + 0.1f * (float)(e / 512));
                for (gi = 0; qg && gi < sizeof groups / sizeof groups[0]; gi++) {
                    for (i = 0; i < reps * 5; i++) {
                        t = now();
                        pqc_pq_search(rt, &pq, &codes, qg, groups[gi], &s1, &scr, idx, NULL);
                        tt[i] = now() - t;
                    }
                    printf("pqcache softmax_group_ns_per_token %s/g%d %.3f\n", cfg_name[ci], groups[gi],
                           median(tt, reps * 5) * 1e9 / (double)s);
                }
                free(qg);
            }
        }
        fflush(stdout);
        pqc_codes_free(&codes);
        pqc_pq_free(&pq);
    }
    free(qsum);
    free(exact_idx);
    free(idx);
    pqc_scratch_free(&scr);
    pqc_runtime_destroy(rt);
    synth_free(&sy);
    return 0;
}
