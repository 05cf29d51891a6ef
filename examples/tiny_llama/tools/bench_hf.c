/* bench_hf.c - decode speed of a Hugging Face-layout model against the
   machine's memory bandwidth (make bench-hf).

   1. Memory bandwidth: a STREAM-like read of a large buffer (--mb MiB,
      default 1024) by --threads threads, three times; the median in GB/s.
   2. Decode: a generated model shaped like Llama-3.2-1B (dim 2048, 16
      layers, 32 query heads, 8 KV heads of 64, hidden 8192, tied embeddings;
      vocabulary --vocab, default 32000) with random bf16 weights, written
      once to --dir (default build/bench_hf_model) as config.json and
      model.safetensors and loaded through the engine's loader (mmap). The KV
      cache is filled with random rows for --ctx positions (default 4096) and
      --steps decode steps (default 8) run after it with full attention; the
      median step time gives the GB/s of weights read per token (every matrix
      once and the classifier), which is compared with the bandwidth. The KV
      cache read per token is reported next to it.
   3. The same decode in pqcache mode (tl_pqcache.h, its default settings:
      32 sinks, budget ratio 0.1, m 2, 6 bits, CPU tier): the same rows are
      handed to the library as a prefill (it stores them and builds the
      codebooks, waited for before timing), and each step selects sinks +
      top-k + the window per layer and KV head and attends over those rows
      only. --attn full or --attn pqcache runs one mode alone.

   They alternate for --reps rounds (default 5), so that each ratio compares
   measurements taken side by side (a shared machine's bandwidth drifts); the
   medians over the rounds are the figures.

   usage: bench_hf [--threads N] [--ctx N] [--steps N] [--reps N] [--mb N]
                   [--dir PATH] [--vocab N] [--attn both|full|pqcache] */
#ifndef __cplusplus
#define _POSIX_C_SOURCE 200809L
#endif
#define TINY_LLAMA_IMPLEMENTATION
#include "../tiny_llama.h"
#define TL_PQCACHE_IMPLEMENTATION
#include "../tl_pqcache.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define DIM 2048
#define LAYERS 16
#define HEADS 32
#define KV_HEADS 8
#define HEAD 64
#define HIDDEN 8192

/* ----------------------------------------------------------------------------
   Memory bandwidth */

typedef struct {
    const unsigned long long *p;
    size_t n;
    unsigned long long sum;
} read_job;

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
__attribute__((target("avx2"))) static unsigned long long read_avx2(const unsigned long long *p, size_t n)
{
    __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
    unsigned long long lanes[4], s = 0;
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        a = _mm256_add_epi64(a, _mm256_loadu_si256((const __m256i *)(const void *)(p + i)));
        b = _mm256_add_epi64(b, _mm256_loadu_si256((const __m256i *)(const void *)(p + i + 4)));
        c = _mm256_add_epi64(c, _mm256_loadu_si256((const __m256i *)(const void *)(p + i + 8)));
        d = _mm256_add_epi64(d, _mm256_loadu_si256((const __m256i *)(const void *)(p + i + 12)));
    }
    a = _mm256_add_epi64(_mm256_add_epi64(a, b), _mm256_add_epi64(c, d));
    _mm256_storeu_si256((__m256i *)(void *)lanes, a);
    s = lanes[0] + lanes[1] + lanes[2] + lanes[3];
    for (; i < n; i++)
        s += p[i];
    return s;
}
#define HAVE_AVX2_READ 1
#endif

static void *read_worker(void *arg)
{
    read_job *j = (read_job *)arg;
    unsigned long long s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    size_t i = 0;
#ifdef HAVE_AVX2_READ
    if (__builtin_cpu_supports("avx2")) {
        j->sum = read_avx2(j->p, j->n);
        return NULL;
    }
#endif
    for (; i + 4 <= j->n; i += 4) {
        s0 += j->p[i];
        s1 += j->p[i + 1];
        s2 += j->p[i + 2];
        s3 += j->p[i + 3];
    }
    for (; i < j->n; i++)
        s0 += j->p[i];
    j->sum = s0 + s1 + s2 + s3;
    return NULL;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* the median of reps reads of buf (n words) by threads threads, in GB/s */
static double bandwidth(const unsigned long long *buf, size_t n, int threads, int reps,
                        unsigned long long *sink)
{
    double gbs[64];
    read_job jobs[64];
    pthread_t th[64];
    int r, t;
    if (reps > 64)
        reps = 64;
    for (r = 0; r < reps; r++) {
        double t0 = tl_time_s(), dt;
        for (t = 0; t < threads; t++) {
            jobs[t].p = buf + n / (size_t)threads * (size_t)t;
            jobs[t].n = t == threads - 1 ? n - n / (size_t)threads * (size_t)t : n / (size_t)threads;
            if (t > 0 && pthread_create(&th[t], NULL, read_worker, &jobs[t]) != 0)
                return 0;
        }
        read_worker(&jobs[0]);
        for (t = 1; t < threads; t++)
            pthread_join(th[t], NULL);
        dt = tl_time_s() - t0;
        for (t = 0; t < threads; t++)
            *sink += jobs[t].sum;
        gbs[r] = (double)(n * 8) / dt / 1e9;
    }
    return median(gbs, reps);
}

/* ----------------------------------------------------------------------------
   The generated model */

static unsigned long long rng_state = 0x9E3779B97F4A7C15ull;

static unsigned short random_bf16(float scale)
{
    float f = ((float)(tl_rng_next(&rng_state) >> 40) / 16777216.0f * 2.0f - 1.0f) * scale;
    unsigned int bits;
    memcpy(&bits, &f, 4);
    return (unsigned short)(bits >> 16);
}

typedef struct {
    char name[96];
    long long rows, cols;   /* cols 0: a vector */
    float scale;
} tensor_spec;

static int n_specs(void) { return 2 + LAYERS * 9; }

static void spec(int i, int vocab, tensor_spec *s)
{
    static const char *const names[9] = {
        "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
        "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight" };
    static const long long rows[9] = { DIM, DIM, HEADS * HEAD, KV_HEADS * HEAD, KV_HEADS * HEAD,
                                       DIM, HIDDEN, HIDDEN, DIM };
    static const long long cols[9] = { 0, 0, DIM, DIM, DIM, HEADS * HEAD, DIM, DIM, HIDDEN };
    if (i == 0) {
        snprintf(s->name, sizeof s->name, "model.embed_tokens.weight");
        s->rows = vocab;
        s->cols = DIM;
        s->scale = 1.0f;
        return;
    }
    if (i == 1) {
        snprintf(s->name, sizeof s->name, "model.norm.weight");
        s->rows = DIM;
        s->cols = 0;
        s->scale = 1.0f;
        return;
    }
    i -= 2;
    snprintf(s->name, sizeof s->name, "model.layers.%d.%s", i / 9, names[i % 9]);
    s->rows = rows[i % 9];
    s->cols = cols[i % 9];
    s->scale = cols[i % 9] ? 1.7f / (float)sqrt((double)cols[i % 9]) : 1.0f;
}

static int write_model(const char *dir, int vocab)
{
    char path[1024];
    FILE *f;
    char *header;
    size_t hl = 0, cap = 64 * 1024, off = 0, k, elems;
    int i;
    unsigned short *row;
    unsigned char len8[8];

    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (!(f = fopen(path, "w")))
        return -1;
    fprintf(f, "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": %d, "
            "\"intermediate_size\": %d, \"num_hidden_layers\": %d, \"num_attention_heads\": %d, "
            "\"num_key_value_heads\": %d, \"head_dim\": %d, \"vocab_size\": %d, "
            "\"max_position_embeddings\": 131072, \"rms_norm_eps\": 1e-05, \"rope_theta\": 500000.0, "
            "\"rope_scaling\": {\"factor\": 32.0, \"high_freq_factor\": 4.0, \"low_freq_factor\": 1.0, "
            "\"original_max_position_embeddings\": 8192, \"rope_type\": \"llama3\"}, "
            "\"tie_word_embeddings\": true, \"hidden_act\": \"silu\", \"torch_dtype\": \"bfloat16\"}\n",
            DIM, HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD, vocab);
    if (fclose(f) != 0)
        return -1;
    header = (char *)malloc(cap);
    if (!header)
        return -1;
    hl += (size_t)snprintf(header + hl, cap - hl, "{");
    for (i = 0; i < n_specs(); i++) {
        tensor_spec s;
        spec(i, vocab, &s);
        elems = (size_t)s.rows * (size_t)(s.cols ? s.cols : 1);
        if (s.cols)
            hl += (size_t)snprintf(header + hl, cap - hl, "%s\"%s\": {\"dtype\": \"BF16\", \"shape\": [%lld, %lld], "
                                   "\"data_offsets\": [%zu, %zu]}", i ? ", " : "", s.name, s.rows, s.cols,
                                   off, off + elems * 2);
        else
            hl += (size_t)snprintf(header + hl, cap - hl, "%s\"%s\": {\"dtype\": \"BF16\", \"shape\": [%lld], "
                                   "\"data_offsets\": [%zu, %zu]}", i ? ", " : "", s.name, s.rows, off,
                                   off + elems * 2);
        off += elems * 2;
    }
    hl += (size_t)snprintf(header + hl, cap - hl, "}");
    while (hl % 8)
        header[hl++] = ' ';
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    if (!(f = fopen(path, "wb"))) {
        free(header);
        return -1;
    }
    for (k = 0; k < 8; k++)
        len8[k] = (unsigned char)((unsigned long long)hl >> (8 * k));
    fwrite(len8, 1, 8, f);
    fwrite(header, 1, hl, f);
    free(header);
    row = (unsigned short *)malloc(HIDDEN * sizeof(unsigned short));
    if (!row) {
        fclose(f);
        return -1;
    }
    for (i = 0; i < n_specs(); i++) {
        tensor_spec s;
        long long r;
        spec(i, vocab, &s);
        for (r = 0; r < (s.cols ? s.rows : 1); r++) {
            long long n = s.cols ? s.cols : s.rows, c;
            for (c = 0; c < n; c++)
                row[c] = s.cols ? random_bf16(s.scale) : 0x3F80;   /* norms: 1.0 */
            fwrite(row, 2, (size_t)n, f);
        }
    }
    free(row);
    return fclose(f) == 0 ? 0 : -1;
}

/* The median time of n decode steps in one mode (0 full attention, 1 pqcache), from
   position *pos on; a negative time when a step fails. */
static double decode_steps(tl_model *m, tl_state *s, tlpq *pq, int mode, int n, int *pos,
                           unsigned long long *rng, int vocab)
{
    double times[256];
    int i;
    for (i = 0; i < n; i++) {
        int tok = (int)(tl_rng_next(rng) % (unsigned long long)vocab);
        double t0 = tl_time_s();
        if (mode == 0 ? !tl_forward(m, s, NULL, tok, *pos) : !tlpq_decode(pq, tok, *pos)) {
            fprintf(stderr, "error: %s\n", mode == 0 ? s->err : pq->err);
            return -1.0;
        }
        times[i] = tl_time_s() - t0;
        (*pos)++;
    }
    return median(times, n);
}

static void report(const char *what, double wbytes, double t, double ratio)
{
    printf("%s %.1f ms/token = %.2f GB/s of weights = %.1f%%", what, 1e3 * t, wbytes / t / 1e9, 100.0 * ratio);
}

int main(int argc, char **argv)
{
    int threads = 2, ctx = 4096, steps = 8, reps = 5, vocab = 32000, i, pos, l, r, mode;
    int modes[2] = { 1, 1 }, at[2];
    size_t mb = 1024, nwords, w;
    const char *dir = "build/bench_hf_model";
    char err[TL_ERR_LEN];
    unsigned long long sink = 0, rng = tl_rng_seed(7), *buf;
    tl_model m;
    tl_state s;
    tlpq pq;
    tlpq_config pcfg;
    tlpq_stats pst;
    double bw[64], t_step[2][64], ratio[2][64], wbytes, kvbytes, t0, bm;
    struct stat st;
    char path[1024];

    for (i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--threads") == 0) threads = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--ctx") == 0) ctx = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--steps") == 0) steps = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--reps") == 0) reps = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--mb") == 0) mb = (size_t)atol(argv[i + 1]);
        else if (strcmp(argv[i], "--dir") == 0) dir = argv[i + 1];
        else if (strcmp(argv[i], "--vocab") == 0) vocab = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--attn") == 0 && strcmp(argv[i + 1], "both") == 0) modes[0] = modes[1] = 1;
        else if (strcmp(argv[i], "--attn") == 0 && strcmp(argv[i + 1], "full") == 0) modes[0] = 1, modes[1] = 0;
        else if (strcmp(argv[i], "--attn") == 0 && strcmp(argv[i + 1], "pqcache") == 0) modes[0] = 0, modes[1] = 1;
        else break;
    }
    if (i != argc || threads < 1 || threads > 64 || ctx < 1 || steps < 1 || steps > 256 || reps < 1 ||
        reps > 64 || steps * reps > 4096 || mb < 16 || vocab < 2) {
        fprintf(stderr, "usage: bench_hf [--threads N] [--ctx N] [--steps N<=256] [--reps N<=64] [--mb N] "
                "[--dir PATH] [--vocab N] [--attn both|full|pqcache]\n");
        return 1;
    }

    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    if (tl_build_model(&m, dir, err, sizeof err) != 0 || m.config.vocab_size != vocab) {
        if (stat(path, &st) == 0)
            tl_free_model(&m);
        fprintf(stderr, "writing the 1B-shaped model to %s ...\n", dir);
        if (write_model(dir, vocab) != 0 || tl_build_model(&m, dir, err, sizeof err) != 0) {
            fprintf(stderr, "error: cannot write or load %s: %s\n", dir, err);
            return 1;
        }
    }
    if (tl_build_state(&s, &m.config, ctx + steps * reps + 3, threads, err, sizeof err) != 0) {
        fprintf(stderr, "error: %s\n", err);
        tl_free_model(&m);
        return 1;
    }
    nwords = mb * 1024 * 1024 / 8;
    buf = (unsigned long long *)malloc(nwords * 8);
    if (!buf) {
        fprintf(stderr, "error: no memory for the %zu MiB bandwidth buffer\n", mb);
        return 1;
    }
    for (w = 0; w < nwords; w++)
        buf[w] = w;
    /* the context: random key and value rows, as if a prompt of ctx tokens had run */
    for (l = 0; l < m.config.n_layers; l++)
        for (pos = 0; pos < ctx; pos++) {
            float *k = tl_key_row(&m.config, &s, l, pos), *v = tl_value_row(&m.config, &s, l, pos);
            int e;
            for (e = 0; e < m.config.kv_dim; e++) {
                k[e] = tl_rng_float(&rng) - 0.5f;
                v[e] = tl_rng_float(&rng) - 0.5f;
            }
        }
    /* pqcache mode: the same rows handed to the library, its codebooks built */
    if (modes[1]) {
        tlpq_default_config(&pcfg);
        pcfg.n_threads = threads;
        if (tlpq_create(&pq, &m, ctx + steps * reps + 3, &pcfg, err, sizeof err) != 0) {
            fprintf(stderr, "error: %s\n", err);
            return 1;
        }
        t0 = tl_time_s();
        for (l = 0; l < m.config.n_layers; l++) {
            pqc_matrix km = pqc_matrix_f32(tl_key_row(&m.config, &s, l, 0), (size_t)ctx, (size_t)m.config.kv_dim);
            pqc_matrix vm = pqc_matrix_f32(tl_value_row(&m.config, &s, l, 0), (size_t)ctx, (size_t)m.config.kv_dim);
            if (pqc_cache_prefill(pq.cache, l, &km, &vm) != PQC_SUCCESS) {
                fprintf(stderr, "error: pqcache prefill: %s\n", pqc_last_error());
                return 1;
            }
        }
        if (pqc_cache_sync(pq.cache) != PQC_SUCCESS) {
            fprintf(stderr, "error: pqcache build: %s\n", pqc_last_error());
            return 1;
        }
        printf("pqcache: %d positions stored and coded in %.1f s (", ctx, tl_time_s() - t0);
        tlpq_describe(&pq, err, sizeof err);
        printf("%s)\n", err);
    }
    wbytes = tl_weight_bytes_per_token(&m);
    kvbytes = 2.0 * m.config.n_layers * (double)ctx * m.config.kv_dim * sizeof(float);
    printf("model: %s, dim %d, %d layers, %d heads (%d KV), hidden %d, vocab %d, %s weights, "
           "%.3f GB read per token\n", tl_arch_name(m.config.arch), m.config.dim, m.config.n_layers,
           m.config.n_heads, m.config.n_kv_heads, m.config.hidden_dim, m.config.vocab_size,
           tl_dtype_name(m.config.wtype), wbytes / 1e9);
    /* two warm-up steps per mode (the mapped weights into the page cache), then the
       rounds: the bandwidth, then each mode's steps */
    at[0] = at[1] = ctx;
    for (r = -1; r < reps; r++) {
        int n = r < 0 ? 2 : steps;
        if (r >= 0)
            bw[r] = bandwidth(buf, nwords, threads, 3, &sink);
        for (mode = 0; mode < 2; mode++) {
            double t;
            if (!modes[mode])
                continue;
            if ((t = decode_steps(&m, &s, &pq, mode, n, &at[mode], &rng, vocab)) < 0)
                return 1;
            if (r < 0)
                continue;
            t_step[mode][r] = t;
            ratio[mode][r] = bw[r] > 0 ? wbytes / t / 1e9 / bw[r] : 0.0;
        }
        if (r < 0)
            continue;
        printf("round %d: bandwidth %.2f GB/s (%zu MiB, %d threads)", r + 1, bw[r], mb, threads);
        if (modes[0])
            report("; full attention", wbytes, t_step[0][r], ratio[0][r]);
        if (modes[1])
            report("; pqcache", wbytes, t_step[1][r], ratio[1][r]);
        printf(" (step medians of %d)\n", steps);
    }
    bm = median(bw, reps);
    printf("memory bandwidth: %.2f GB/s (median of %d rounds)\n", bm, reps);
    for (mode = 0; mode < 2; mode++) {
        double tm, rm;
        if (!modes[mode])
            continue;
        tm = median(t_step[mode], reps);
        rm = median(ratio[mode], reps);
        printf("decode at context %d, %d threads, %s: %.1f ms/token (median of %d rounds), %.2f tok/s\n", ctx,
               threads, mode ? "pqcache" : "full attention", 1e3 * tm, reps, 1.0 / tm);
        printf("  weights: %.2f GB/s per token = %.1f%% of the measured bandwidth (median of the rounds' "
               "ratios)\n", wbytes / tm / 1e9, 100.0 * rm);
        if (mode == 0)
            printf("  weights + KV cache (%.3f GB fp32): %.2f GB/s per token = %.1f%% of the measured bandwidth\n",
                   kvbytes / 1e9, (wbytes + kvbytes) / tm / 1e9,
                   bm > 0 ? 100.0 * (wbytes + kvbytes) / tm / 1e9 / bm : 0.0);
    }
    if (modes[1]) {
        tlpq_get_stats(&pq, &pst);
        printf("  pqcache: %.1f tokens attended per layer and KV head on average (of %d to %d), select %.2f ms "
               "and fetch %.2f ms per token\n",
               pst.selects ? (double)pst.tokens_selected / (double)pst.selects / m.config.n_kv_heads : 0.0, ctx + 1,
               at[1],
               1e3 * pst.select_s / (double)(at[1] - ctx), 1e3 * pst.fetch_s / (double)(at[1] - ctx));
        printf("  pqcache: %llu codebook builds (%llu of them rebuilds during the decode, on the library's "
               "threads), %.2f s waited for builds (the first ones included)\n", pst.builds, pst.rebuilds, pst.wait_s);
        tlpq_destroy(&pq);
    }
    free(buf);
    if (sink == 42)
        printf(" ");
    tl_free_state(&s);
    tl_free_model(&m);
    return 0;
}
