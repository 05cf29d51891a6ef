/* test_tiny_llama.c - tests of the tiny_llama engine.

   Checkpoints are written here by a writer of the test's own, and the
   full-attention forward is compared with a reference that reads the file
   and computes the transformer with plain loops in double precision, sharing
   no code with the engine.

   Prints one line per test and ends with "N passed, N failed"; the exit
   status is non-zero if any test failed. */
#ifndef __cplusplus
#define _POSIX_C_SOURCE 200809L
#endif
#define TINY_LLAMA_IMPLEMENTATION
#include "tiny_llama.h"

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tl_test.h"

static unsigned char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    unsigned char *buf;
    long n;
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fseek(f, 0, SEEK_SET);
    buf = (unsigned char *)malloc((size_t)n + 1);
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    *len = (size_t)n;
    return buf;
}

static int write_file(const char *path, const unsigned char *buf, size_t len)
{
    FILE *f = fopen(path, "wb");
    int ok;
    if (!f)
        return -1;
    ok = fwrite(buf, 1, len, f) == len;
    return fclose(f) == 0 && ok ? 0 : -1;
}

/* ----------------------------------------------------------------------------
   The test's own checkpoint writer (llama2.c formats) */

typedef struct {
    int dim, hidden, layers, heads, kv_heads, vocab, seq_len, shared;
    int legacy;
    float theta;      /* written as is in version 1 headers (0 = default) */
    unsigned seed;
} spec;

static float next_uniform(unsigned *state)
{
    *state = *state * 1664525u + 1013904223u;
    return (float)(*state >> 8) / 16777216.0f - 0.5f;   /* [-0.5, 0.5) */
}

static void put_floats(FILE *f, size_t n, float base, float scale, unsigned *rng)
{
    size_t i;
    for (i = 0; i < n; i++) {
        float v = base + scale * next_uniform(rng);
        fwrite(&v, sizeof v, 1, f);
    }
}

static int write_spec(const char *path, const spec *s)
{
    FILE *f = fopen(path, "wb");
    size_t D = (size_t)s->dim, H = (size_t)s->hidden, L = (size_t)s->layers;
    size_t hs = D / (size_t)s->heads, KV = hs * (size_t)s->kv_heads, V = (size_t)s->vocab;
    float mat = 2.0f / sqrtf((float)s->dim);
    unsigned rng = s->seed * 2654435761u + 1u;
    int ints[7];
    if (!f)
        return -1;
    ints[0] = s->dim; ints[1] = s->hidden; ints[2] = s->layers; ints[3] = s->heads;
    ints[4] = s->kv_heads; ints[5] = s->vocab; ints[6] = s->seq_len;
    if (s->legacy) {
        if (!s->shared)
            ints[5] = -s->vocab;
        fwrite(ints, sizeof(int), 7, f);
        put_floats(f, V * D, 0.0f, 2.0f, &rng);        /* token_embedding */
        put_floats(f, L * D, 1.0f, 0.4f, &rng);        /* rms_att */
        put_floats(f, L * D * D, 0.0f, mat, &rng);     /* wq */
        put_floats(f, L * KV * D, 0.0f, mat, &rng);    /* wk */
        put_floats(f, L * KV * D, 0.0f, mat, &rng);    /* wv */
        put_floats(f, L * D * D, 0.0f, mat, &rng);     /* wo */
        put_floats(f, L * D, 1.0f, 0.4f, &rng);        /* rms_ffn */
        put_floats(f, L * H * D, 0.0f, mat, &rng);     /* w1 */
        put_floats(f, L * D * H, 0.0f, mat, &rng);     /* w2 */
        put_floats(f, L * H * D, 0.0f, mat, &rng);     /* w3 */
        put_floats(f, D, 1.0f, 0.4f, &rng);            /* rms_final */
        put_floats(f, (size_t)s->seq_len * hs, 0.0f, 1.0f, &rng);  /* RoPE tables */
    } else {
        unsigned char pad[256];
        unsigned magic = 0x616b3432u;
        int version = 1;
        memset(pad, 0, sizeof pad);
        fwrite(&magic, 4, 1, f);
        fwrite(&version, 4, 1, f);
        fwrite(ints, sizeof(int), 7, f);
        pad[0] = (unsigned char)s->shared;       /* byte 36 */
        memcpy(pad + 4, &s->theta, 4);           /* byte 40 */
        fwrite(pad, 1, 256 - 36, f);
        put_floats(f, L * D, 1.0f, 0.4f, &rng);        /* rms_att */
        put_floats(f, L * D, 1.0f, 0.4f, &rng);        /* rms_ffn */
        put_floats(f, D, 1.0f, 0.4f, &rng);            /* rms_final */
        put_floats(f, V * D, 0.0f, 2.0f, &rng);        /* token_embedding */
        put_floats(f, L * D * D, 0.0f, mat, &rng);     /* wq */
        put_floats(f, L * KV * D, 0.0f, mat, &rng);    /* wk */
        put_floats(f, L * KV * D, 0.0f, mat, &rng);    /* wv */
        put_floats(f, L * D * D, 0.0f, mat, &rng);     /* wo */
        put_floats(f, L * H * D, 0.0f, mat, &rng);     /* w1 */
        put_floats(f, L * D * H, 0.0f, mat, &rng);     /* w2 */
        put_floats(f, L * H * D, 0.0f, mat, &rng);     /* w3 */
    }
    if (!s->shared)
        put_floats(f, V * D, 0.0f, mat * 4.0f, &rng);  /* wcls */
    return fclose(f) == 0 ? 0 : -1;
}

static spec small_spec(void)
{
    spec s;
    memset(&s, 0, sizeof s);
    s.dim = 32; s.hidden = 48; s.layers = 2; s.heads = 4; s.kv_heads = 2;
    s.vocab = 40; s.seq_len = 48; s.shared = 1; s.theta = 500000.0f; s.seed = 7;
    return s;
}

/* ----------------------------------------------------------------------------
   Reference forward: plain loops, double precision, reads the file itself */

typedef struct {
    int dim, hidden, layers, heads, kv_heads, vocab, seq_len, hs, kv_dim;
    double theta;
    float *data;
    const float *emb, *rms_att, *rms_ffn, *rms_final, *wq, *wk, *wv, *wo, *w1, *w2, *w3, *wcls;
    double *kcache, *vcache;   /* [layer][pos][kv_dim] */
} ref_model;

static int ref_load(ref_model *r, const char *path)
{
    size_t len, off;
    unsigned char *buf = read_file(path, &len);
    int ints[7], shared, legacy;
    unsigned magic;
    const float *p;
    size_t D, H, L, KV, V;
    if (!buf)
        return -1;
    memset(r, 0, sizeof *r);
    memcpy(&magic, buf, 4);
    legacy = magic != 0x616b3432u;
    if (legacy) {
        memcpy(ints, buf, sizeof ints);
        shared = ints[5] > 0;
        if (ints[5] < 0)
            ints[5] = -ints[5];
        r->theta = 10000.0;
        off = 28;
    } else {
        float theta;
        memcpy(ints, buf + 8, sizeof ints);
        shared = buf[36];
        memcpy(&theta, buf + 40, 4);
        r->theta = theta == 0.0f ? 10000.0 : (double)theta;
        off = 256;
    }
    r->dim = ints[0]; r->hidden = ints[1]; r->layers = ints[2]; r->heads = ints[3];
    r->kv_heads = ints[4]; r->vocab = ints[5]; r->seq_len = ints[6];
    r->hs = r->dim / r->heads;
    r->kv_dim = r->hs * r->kv_heads;
    r->data = (float *)malloc(len - off);
    memcpy(r->data, buf + off, len - off);
    free(buf);
    D = (size_t)r->dim; H = (size_t)r->hidden; L = (size_t)r->layers;
    KV = (size_t)r->kv_dim; V = (size_t)r->vocab;
    p = r->data;
    if (legacy) {
        r->emb = p; p += V * D;
        r->rms_att = p; p += L * D;
        r->wq = p; p += L * D * D;
        r->wk = p; p += L * KV * D;
        r->wv = p; p += L * KV * D;
        r->wo = p; p += L * D * D;
        r->rms_ffn = p; p += L * D;
        r->w1 = p; p += L * H * D;
        r->w2 = p; p += L * D * H;
        r->w3 = p; p += L * H * D;
        r->rms_final = p; p += D;
        p += (size_t)r->seq_len * (size_t)r->hs;
    } else {
        r->rms_att = p; p += L * D;
        r->rms_ffn = p; p += L * D;
        r->rms_final = p; p += D;
        r->emb = p; p += V * D;
        r->wq = p; p += L * D * D;
        r->wk = p; p += L * KV * D;
        r->wv = p; p += L * KV * D;
        r->wo = p; p += L * D * D;
        r->w1 = p; p += L * H * D;
        r->w2 = p; p += L * D * H;
        r->w3 = p; p += L * H * D;
    }
    r->wcls = shared ? r->emb : p;
    r->kcache = (double *)calloc(L * (size_t)r->seq_len * KV, sizeof(double));
    r->vcache = (double *)calloc(L * (size_t)r->seq_len * KV, sizeof(double));
    return 0;
}

static void ref_free(ref_model *r)
{
    free(r->data);
    free(r->kcache);
    free(r->vcache);
}

static void ref_rmsnorm(double *out, const double *x, const float *w, int n)
{
    double ss = 0.0;
    int i;
    for (i = 0; i < n; i++)
        ss += x[i] * x[i];
    ss = 1.0 / sqrt(ss / n + 1e-5);
    for (i = 0; i < n; i++)
        out[i] = w[i] * x[i] * ss;
}

/* out[r] = sum_c W[r][c] in[c] */
static void ref_matvec(double *out, const float *w, const double *in, int rows, int cols)
{
    int r, c;
    for (r = 0; r < rows; r++) {
        double acc = 0.0;
        for (c = 0; c < cols; c++)
            acc += (double)w[(size_t)r * (size_t)cols + (size_t)c] * in[c];
        out[r] = acc;
    }
}

static void ref_rope(double *v, int n, int hs, int pos, double theta)
{
    int d;
    for (d = 0; d < n; d += 2) {
        int pair = (d % hs) / 2;
        double angle = pos * pow(theta, -2.0 * pair / hs);
        double a = v[d], b = v[d + 1];
        v[d] = a * cos(angle) - b * sin(angle);
        v[d + 1] = a * sin(angle) + b * cos(angle);
    }
}

/* logits (vocab) for token at pos; positions before pos must have been run */
static void ref_forward(ref_model *r, int token, int pos, double *logits)
{
    int D = r->dim, H = r->hidden, hs = r->hs, KV = r->kv_dim, l, h, i, t;
    double *x = (double *)calloc((size_t)D, sizeof(double));
    double *xn = (double *)calloc((size_t)D, sizeof(double));
    double *q = (double *)calloc((size_t)D, sizeof(double));
    double *att_out = (double *)calloc((size_t)D, sizeof(double));
    double *o = (double *)calloc((size_t)D, sizeof(double));
    double *h1 = (double *)calloc((size_t)H, sizeof(double));
    double *h3 = (double *)calloc((size_t)H, sizeof(double));
    double *scores = (double *)calloc((size_t)pos + 1, sizeof(double));
    for (i = 0; i < D; i++)
        x[i] = r->emb[(size_t)token * (size_t)D + (size_t)i];
    for (l = 0; l < r->layers; l++) {
        double *k = r->kcache + ((size_t)l * (size_t)r->seq_len + (size_t)pos) * (size_t)KV;
        double *v = r->vcache + ((size_t)l * (size_t)r->seq_len + (size_t)pos) * (size_t)KV;
        ref_rmsnorm(xn, x, r->rms_att + (size_t)l * (size_t)D, D);
        ref_matvec(q, r->wq + (size_t)l * (size_t)D * (size_t)D, xn, D, D);
        ref_matvec(k, r->wk + (size_t)l * (size_t)KV * (size_t)D, xn, KV, D);
        ref_matvec(v, r->wv + (size_t)l * (size_t)KV * (size_t)D, xn, KV, D);
        ref_rope(q, D, hs, pos, r->theta);
        ref_rope(k, KV, hs, pos, r->theta);
        for (h = 0; h < r->heads; h++) {
            int g = h / (r->heads / r->kv_heads);
            double max = -1e300, sum = 0.0;
            for (t = 0; t <= pos; t++) {
                const double *kt = r->kcache +
                    ((size_t)l * (size_t)r->seq_len + (size_t)t) * (size_t)KV + (size_t)g * (size_t)hs;
                double dot = 0.0;
                for (i = 0; i < hs; i++)
                    dot += q[h * hs + i] * kt[i];
                scores[t] = dot / sqrt((double)hs);
                if (scores[t] > max)
                    max = scores[t];
            }
            for (t = 0; t <= pos; t++) {
                scores[t] = exp(scores[t] - max);
                sum += scores[t];
            }
            for (i = 0; i < hs; i++)
                att_out[h * hs + i] = 0.0;
            for (t = 0; t <= pos; t++) {
                const double *vt = r->vcache +
                    ((size_t)l * (size_t)r->seq_len + (size_t)t) * (size_t)KV + (size_t)g * (size_t)hs;
                for (i = 0; i < hs; i++)
                    att_out[h * hs + i] += scores[t] / sum * vt[i];
            }
        }
        ref_matvec(o, r->wo + (size_t)l * (size_t)D * (size_t)D, att_out, D, D);
        for (i = 0; i < D; i++)
            x[i] += o[i];
        ref_rmsnorm(xn, x, r->rms_ffn + (size_t)l * (size_t)D, D);
        ref_matvec(h1, r->w1 + (size_t)l * (size_t)H * (size_t)D, xn, H, D);
        ref_matvec(h3, r->w3 + (size_t)l * (size_t)H * (size_t)D, xn, H, D);
        for (i = 0; i < H; i++)
            h1[i] = h1[i] / (1.0 + exp(-h1[i])) * h3[i];
        ref_matvec(o, r->w2 + (size_t)l * (size_t)D * (size_t)H, h1, D, H);
        for (i = 0; i < D; i++)
            x[i] += o[i];
    }
    ref_rmsnorm(xn, x, r->rms_final, D);
    ref_matvec(logits, r->wcls, xn, r->vocab, D);
    free(x); free(xn); free(q); free(att_out); free(o); free(h1); free(h3); free(scores);
}

/* Runs the engine (full attention) and the reference over n tokens of the
   checkpoint at path; returns the largest absolute logit difference. */
static double max_diff_vs_reference(const char *path, int n)
{
    tl_model m;
    tl_state s;
    ref_model r;
    char err[TL_ERR_LEN];
    double worst = -1.0, *ref_logits;
    int pos, i;
    if (tl_build_model(&m, path, err, sizeof err)) {
        printf("  load failed: %s\n", err);
        return 1e30;
    }
    if (tl_build_state(&s, &m.config, 0, 1, err, sizeof err) || ref_load(&r, path)) {
        tl_free_model(&m);
        return 1e30;
    }
    ref_logits = (double *)calloc((size_t)r.vocab, sizeof(double));
    for (pos = 0; pos < n && pos < r.seq_len; pos++) {
        int token = (pos * 7 + 3) % r.vocab;
        float *logits = tl_forward(&m, &s, NULL, token, pos);
        ref_forward(&r, token, pos, ref_logits);
        if (!logits)
            return 1e30;
        for (i = 0; i < r.vocab; i++) {
            double d = fabs((double)logits[i] - ref_logits[i]);
            if (d > worst)
                worst = d;
        }
    }
    free(ref_logits);
    ref_free(&r);
    tl_free_state(&s);
    tl_free_model(&m);
    return worst;
}

/* ----------------------------------------------------------------------------
   Tests: checkpoint validation */

/* loading path must fail with a message containing `want` */
static int rejects(const char *path, const char *want)
{
    tl_model m;
    char err[TL_ERR_LEN];
    err[0] = '\0';
    if (tl_build_model(&m, path, err, sizeof err) == 0) {
        printf("  %s was accepted\n", path);
        tl_free_model(&m);
        return 0;
    }
    if (err[0] == '\0' || !strstr(err, want)) {
        printf("  error '%s' does not mention '%s'\n", err, want);
        return 0;
    }
    return 1;
}

static int accepts(const char *path)
{
    tl_model m;
    char err[TL_ERR_LEN];
    if (tl_build_model(&m, path, err, sizeof err) != 0) {
        printf("  rejected: %s\n", err);
        return 0;
    }
    tl_free_model(&m);
    return 1;
}

/* copy of the valid file at src with bytes [off, off+4) replaced by v */
static const char *patched(const char *src, const char *name, size_t off, const void *v, size_t n)
{
    size_t len;
    unsigned char *buf = read_file(src, &len);
    const char *path = tmp_path(name);
    if (!buf)
        return path;
    if (off + n <= len)
        memcpy(buf + off, v, n);
    write_file(path, buf, len);
    free(buf);
    return path;
}

static const char *resized(const char *src, const char *name, long delta)
{
    size_t len;
    unsigned char *buf = read_file(src, &len);
    unsigned char *big;
    const char *path = tmp_path(name);
    if (!buf)
        return path;
    big = (unsigned char *)calloc(len + 64, 1);
    memcpy(big, buf, len);
    write_file(path, big, (size_t)((long)len + delta));
    free(buf);
    free(big);
    return path;
}

static void test_valid_checkpoints_load(void)
{
    spec s = small_spec();
    CHECK(write_spec(tmp_path("v1.bin"), &s) == 0);
    CHECK(accepts(tmp_path("v1.bin")));
    s.legacy = 1;
    s.shared = 0;
    CHECK(write_spec(tmp_path("legacy.bin"), &s) == 0);
    CHECK(accepts(tmp_path("legacy.bin")));
    {
        tl_model m;
        char err[TL_ERR_LEN];
        CHECK(tl_build_model(&m, tmp_path("legacy.bin"), err, sizeof err) == 0);
        CHECK(m.config.vocab_size == 40 && m.config.shared_classifier == 0);
        CHECK(m.config.head_size == 8 && m.config.kv_dim == 16);
        CHECK(m.config.rope_theta == 10000.0f && m.config.version == 0);
        tl_free_model(&m);
        CHECK(tl_build_model(&m, tmp_path("v1.bin"), err, sizeof err) == 0);
        CHECK(m.config.rope_theta == 500000.0f && m.config.version == 1);
        CHECK(m.config.shared_classifier == 1 && m.w.wcls == m.w.token_embedding);
        tl_free_model(&m);
    }
}

static void test_truncated_and_oversized(void)
{
    spec s = small_spec();
    char v1[600], leg[600];   /* own copies: tmp_path reuses its buffers */
    size_t len;
    unsigned char *buf;
    strcpy(v1, tmp_path("ok_v1.bin"));
    strcpy(leg, tmp_path("ok_legacy.bin"));
    write_spec(v1, &s);
    s.legacy = 1;
    write_spec(leg, &s);
    CHECK(rejects(resized(v1, "short.bin", -4), "truncated"));
    CHECK(rejects(resized(v1, "long.bin", 4), "trailing"));
    CHECK(rejects(resized(v1, "long1.bin", 1), "trailing"));
    CHECK(rejects(resized(leg, "lshort.bin", -4), "truncated"));
    CHECK(rejects(resized(leg, "llong.bin", 8), "trailing"));
    /* header cut off */
    buf = read_file(v1, &len);
    write_file(tmp_path("head100.bin"), buf, 100);
    CHECK(rejects(tmp_path("head100.bin"), "truncated header"));
    write_file(tmp_path("head3.bin"), buf, 3);
    CHECK(rejects(tmp_path("head3.bin"), "too small"));
    write_file(tmp_path("empty.bin"), buf, 0);
    CHECK(rejects(tmp_path("empty.bin"), "empty"));
    free(buf);
    buf = read_file(leg, &len);
    write_file(tmp_path("lhead20.bin"), buf, 20);
    CHECK(rejects(tmp_path("lhead20.bin"), "not a checkpoint"));
    free(buf);
    CHECK(rejects(tmp_path("does_not_exist.bin"), "cannot open"));
}

static void test_corrupted_headers(void)
{
    spec s = small_spec();
    char v1[600], leg[600];   /* own copies: tmp_path reuses its buffers */
    const char *names[7] = { "dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads",
                             "vocab_size", "seq_len" };
    unsigned char bad_magic[4] = { 0x32, 0x34, 0x6b, 0x62 };
    unsigned char one = 1, two = 2;
    int i, v, zero = 0, neg = -3, big = 0x40000000, int_min = -2147483647 - 1;
    float theta;
    strcpy(v1, tmp_path("ok_v1.bin"));
    strcpy(leg, tmp_path("ok_legacy.bin"));
    write_spec(v1, &s);
    s.legacy = 1;
    write_spec(leg, &s);

    CHECK(rejects(patched(v1, "magic.bin", 0, bad_magic, 4), "not a checkpoint"));
    v = 2;
    CHECK(rejects(patched(v1, "ver2.bin", 4, &v, 4), "version 2 is not supported"));
    v = 0;
    CHECK(rejects(patched(v1, "ver0.bin", 4, &v, 4), "version 0 is not supported"));
    for (i = 0; i < 7; i++) {
        char name[64];
        snprintf(name, sizeof name, "zero%d.bin", i);
        CHECK(rejects(patched(v1, name, 8 + 4 * (size_t)i, &zero, 4), names[i]));
        snprintf(name, sizeof name, "neg%d.bin", i);
        CHECK(rejects(patched(v1, name, 8 + 4 * (size_t)i, &neg, 4), names[i]));
        snprintf(name, sizeof name, "lzero%d.bin", i);
        CHECK(rejects(patched(leg, name, 4 * (size_t)i, &zero, 4), names[i]));
        /* 2^30: inconsistent with the file size (a version 1 file's size does
           not depend on seq_len, a legacy one's does through the RoPE tables) */
        snprintf(name, sizeof name, "big%d.bin", i);
        if (i < 6)
            CHECK(rejects(patched(v1, name, 8 + 4 * (size_t)i, &big, 4), "version 1 header"));
        else
            CHECK(rejects(patched(leg, name, 4 * (size_t)i, &big, 4), "legacy header"));
    }
    /* legacy: negative vocab is valid (own classifier), INT_MIN is not */
    CHECK(rejects(patched(leg, "lmin.bin", 20, &int_min, 4), "vocab_size"));
    /* n_heads 4, n_kv_heads 3 */
    v = 3;
    CHECK(rejects(patched(v1, "gqa.bin", 24, &v, 4), "multiple of n_kv_heads"));
    CHECK(rejects(patched(leg, "lgqa.bin", 16, &v, 4), "multiple of n_kv_heads"));
    /* n_kv_heads > n_heads: 8 > 4 */
    v = 8;
    CHECK(rejects(patched(v1, "kvbig.bin", 24, &v, 4), "multiple of n_kv_heads"));
    /* dim 32 with 3 heads does not divide; with 16 heads the head size is 2,
       with 32 heads it is 1 (odd), with 4 heads and dim 12 it is 3 (odd) */
    v = 3;
    CHECK(rejects(patched(v1, "heads3.bin", 20, &v, 4), "not a multiple of n_heads"));
    v = 12;
    CHECK(rejects(patched(v1, "odd.bin", 8, &v, 4), "odd"));
    v = 32;
    {
        const char *p = patched(v1, "odd32a.bin", 20, &v, 4);
        CHECK(rejects(patched(p, "odd32.bin", 24, &v, 4), "odd"));
    }
    CHECK(rejects(patched(v1, "shared2.bin", 36, &two, 1), "shared_classifier"));
    CHECK(rejects(patched(v1, "pad.bin", 100, &one, 1), "padding byte 100"));
    CHECK(rejects(patched(v1, "pad37.bin", 37, &one, 1), "padding byte 37"));
    theta = -1.0f;
    CHECK(rejects(patched(v1, "theta_neg.bin", 40, &theta, 4), "rope_theta"));
    theta = (float)NAN;
    CHECK(rejects(patched(v1, "theta_nan.bin", 40, &theta, 4), "rope_theta"));
    theta = (float)INFINITY;
    CHECK(rejects(patched(v1, "theta_inf.bin", 40, &theta, 4), "rope_theta"));
    /* sizes whose product overflows size_t */
    {
        const char *p = patched(v1, "ovf_a.bin", 8, &big, 4);        /* dim 2^30 */
        p = patched(p, "ovf_b.bin", 12, &big, 4);                     /* hidden 2^30 */
        v = 0x7fffffff;
        p = patched(p, "ovf_c.bin", 16, &v, 4);                       /* layers */
        CHECK(rejects(p, "version 1 header"));
    }
}

static void test_parse_header_direct(void)
{
    unsigned char h[256];
    tl_config c;
    size_t off = 0;
    char err[TL_ERR_LEN];
    tl_config want;
    memset(h, 0, sizeof h);
    /* a legacy header claims 28 + n floats; check the size it computes */
    memset(&want, 0, sizeof want);
    want.dim = 8; want.hidden_dim = 16; want.n_layers = 1; want.n_heads = 2;
    want.n_kv_heads = 1; want.vocab_size = 10; want.seq_len = 4;
    want.shared_classifier = 1; want.rope_theta = 10000.0f;
    CHECK(tl_check_config(&want, err, sizeof err) == 0);
    /* floats: emb 80, rms_att 8, wq 64, wk 32, wv 32, wo 64, rms_ffn 8,
       w1 128, w2 128, w3 128, rms_final 8, rope 4 * 4 = 16 */
    CHECK(tl_checkpoint_size(&want, 0) == 28 + 4 * (80 + 8 + 64 + 32 + 32 + 64 + 8 +
                                                    128 * 3 + 8 + 16));
    CHECK(tl_checkpoint_size(&want, 1) == 256 + 4 * (80 + 8 + 64 + 32 + 32 + 64 + 8 +
                                                     128 * 3 + 8));
    {
        int ints[7] = { 8, 16, 1, 2, 1, 10, 4 };
        memcpy(h, ints, sizeof ints);
        CHECK(tl_parse_header(h, 28, tl_checkpoint_size(&want, 0), &c, &off, err, sizeof err) == 0);
        CHECK(off == 28 && c.kv_dim == 4 && c.head_size == 4);
        CHECK(tl_parse_header(h, 28, tl_checkpoint_size(&want, 0) + 4, &c, &off, err,
                              sizeof err) != 0);
        CHECK(tl_parse_header(h, 2, 2, &c, &off, err, sizeof err) != 0);
    }
}

/* ----------------------------------------------------------------------------
   Tests: forward against the reference */

static void test_forward_matches_reference(void)
{
    spec s = small_spec();
    double d;
    /* version 1, shared classifier, GQA 4:2, theta 500000, head size 8 */
    write_spec(tmp_path("ref1.bin"), &s);
    d = max_diff_vs_reference(tmp_path("ref1.bin"), 20);
    printf("  v1 GQA: max |diff| %.2e\n", d);
    CHECK(d >= 0.0 && d < 1e-4);
    /* version 1, own classifier, theta 0 (default), MQA, head size 6 */
    s.dim = 24; s.heads = 4; s.kv_heads = 1; s.shared = 0; s.theta = 0.0f; s.seed = 11;
    write_spec(tmp_path("ref2.bin"), &s);
    d = max_diff_vs_reference(tmp_path("ref2.bin"), 20);
    printf("  v1 MQA: max |diff| %.2e\n", d);
    CHECK(d >= 0.0 && d < 1e-4);
    /* legacy, own classifier, MHA, head size 16, 3 layers */
    s = small_spec();
    s.legacy = 1; s.shared = 0; s.heads = 2; s.kv_heads = 2; s.layers = 3; s.seed = 5;
    write_spec(tmp_path("ref3.bin"), &s);
    d = max_diff_vs_reference(tmp_path("ref3.bin"), 20);
    printf("  legacy MHA: max |diff| %.2e\n", d);
    CHECK(d >= 0.0 && d < 1e-4);
    /* legacy, shared classifier */
    s.shared = 1; s.seed = 9;
    write_spec(tmp_path("ref4.bin"), &s);
    d = max_diff_vs_reference(tmp_path("ref4.bin"), 20);
    printf("  legacy shared: max |diff| %.2e\n", d);
    CHECK(d >= 0.0 && d < 1e-4);
}

static tl_config gen_config(void)
{
    tl_config c;
    memset(&c, 0, sizeof c);
    c.dim = 32; c.hidden_dim = 64; c.n_layers = 2; c.n_heads = 4; c.n_kv_heads = 2;
    c.vocab_size = 50; c.seq_len = 64; c.shared_classifier = 1; c.rope_theta = 10000.0f;
    return c;
}

static void test_generator(void)
{
    tl_config c = gen_config();
    char err[TL_ERR_LEN];
    tl_model a, b;
    tl_state sa, sb;
    int pos, same = 1;
    double d;
    c.shared_classifier = 0;
    CHECK(tl_write_random_checkpoint(tmp_path("gen1.bin"), &c, 0, 3, err, sizeof err) == 0);
    CHECK(tl_write_random_checkpoint(tmp_path("gen0.bin"), &c, 1, 3, err, sizeof err) == 0);
    d = max_diff_vs_reference(tmp_path("gen1.bin"), 16);
    CHECK(d >= 0.0 && d < 1e-4);
    /* same seed: the same model in both formats */
    CHECK(tl_build_model(&a, tmp_path("gen1.bin"), err, sizeof err) == 0);
    CHECK(tl_build_model(&b, tmp_path("gen0.bin"), err, sizeof err) == 0);
    CHECK(a.config.version == 1 && b.config.version == 0);
    CHECK(tl_build_state(&sa, &a.config, 0, 1, err, sizeof err) == 0);
    CHECK(tl_build_state(&sb, &b.config, 0, 1, err, sizeof err) == 0);
    for (pos = 0; pos < 10; pos++) {
        float *la = tl_forward(&a, &sa, NULL, pos * 3 % 50, pos);
        float *lb = tl_forward(&b, &sb, NULL, pos * 3 % 50, pos);
        same &= la && lb && memcmp(la, lb, 50 * sizeof(float)) == 0;
    }
    CHECK(same);
    tl_free_state(&sa); tl_free_state(&sb);
    tl_free_model(&a); tl_free_model(&b);
    /* a legacy header cannot carry theta; a bad config is refused */
    c.rope_theta = 5e5f;
    CHECK(tl_write_random_checkpoint(tmp_path("gen2.bin"), &c, 1, 3, err, sizeof err) != 0);
    c.rope_theta = 0.0f;
    c.n_kv_heads = 3;
    CHECK(tl_write_random_checkpoint(tmp_path("gen3.bin"), &c, 0, 3, err, sizeof err) != 0);
}

/* ----------------------------------------------------------------------------
   Tests: attention modes */

/* Prefill n_prompt tokens with full attention, then decode n_steps more
   (teacher-forced, the same tokens for every mode) under policy p; the
   logits of every decode step go to out (n_steps * vocab). */
static int run_mode(const tl_model *m, const tl_policy *p, int n_threads, int n_prompt,
                    int n_steps, float *out)
{
    tl_state s;
    char err[TL_ERR_LEN];
    int pos, V = m->config.vocab_size;
    if (tl_build_state(&s, &m->config, n_prompt + n_steps, n_threads, err, sizeof err))
        return -1;
    s.thread_min_work = 0;
    for (pos = 0; pos < n_prompt + n_steps; pos++) {
        int token = (pos * 13 + 5) % V;
        float *logits = tl_forward(m, &s, pos < n_prompt ? NULL : p, token, pos);
        if (!logits) {
            printf("  forward: %s\n", s.err);
            tl_free_state(&s);
            return -1;
        }
        if (pos >= n_prompt)
            memcpy(out + (size_t)(pos - n_prompt) * (size_t)V, logits, (size_t)V * sizeof(float));
    }
    tl_free_state(&s);
    return 0;
}

static void test_modes_with_full_budget_equal_full(void)
{
    tl_config c = gen_config();
    tl_model m;
    tl_policy full, p;
    char err[TL_ERR_LEN];
    int np = 6, ns = 40, sinks;
    size_t n = (size_t)ns * 50;
    float *ref = (float *)malloc(n * sizeof(float)), *got = (float *)malloc(n * sizeof(float));
    CHECK(tl_write_random_checkpoint(tmp_path("modes.bin"), &c, 0, 21, err, sizeof err) == 0);
    CHECK(tl_build_model(&m, tmp_path("modes.bin"), err, sizeof err) == 0);
    tl_default_policy(&full, TL_ATTN_FULL);
    CHECK(run_mode(&m, &full, 1, np, ns, ref) == 0);
    for (sinks = 0; sinks <= 32; sinks += 4) {
        tl_default_policy(&p, TL_ATTN_WINDOW);
        p.ratio = 1.0f;
        p.n_sink = sinks;
        CHECK(run_mode(&m, &p, 1, np, ns, got) == 0);
        CHECK(memcmp(ref, got, n * sizeof(float)) == 0);
        tl_default_policy(&p, TL_ATTN_ORACLE);
        p.ratio = 1.0f;
        p.n_sink = sinks;
        CHECK(run_mode(&m, &p, 1, np, ns, got) == 0);
        CHECK(memcmp(ref, got, n * sizeof(float)) == 0);
    }
    /* a real restriction changes the result (so the checks above can fail) */
    tl_default_policy(&p, TL_ATTN_WINDOW);
    p.ratio = 0.1f;
    p.n_sink = 2;
    CHECK(run_mode(&m, &p, 1, np, ns, got) == 0);
    CHECK(memcmp(ref, got, n * sizeof(float)) != 0);
    tl_default_policy(&p, TL_ATTN_ORACLE);
    p.ratio = 0.2f;
    p.n_sink = 2;
    CHECK(run_mode(&m, &p, 1, np, ns, got) == 0);
    CHECK(memcmp(ref, got, n * sizeof(float)) != 0);
    /* two threads give the same numbers */
    CHECK(run_mode(&m, &full, 2, np, ns, got) == 0);
    CHECK(memcmp(ref, got, n * sizeof(float)) == 0);
    tl_free_model(&m);
    free(ref);
    free(got);
}

static void test_budget(void)
{
    tl_policy p;
    int s, w, k;
    tl_default_policy(&p, TL_ATTN_ORACLE);
    tl_budget(&p, 32768, &s, &w, &k);
    CHECK(s == 32 && w == 1637 && k == 1637);   /* 0.1 * 32736 = 3273.6 -> 3274 */
    p.mode = TL_ATTN_WINDOW;
    tl_budget(&p, 32768, &s, &w, &k);
    CHECK(s == 32 && w == 3274 && k == 0);
    tl_budget(&p, 20, &s, &w, &k);
    CHECK(s == 20 && w == 0 && k == 0);
    p.ratio = 0.0f;
    tl_budget(&p, 100, &s, &w, &k);
    CHECK(s == 32 && w == 1 && k == 0);
    p.mode = TL_ATTN_ORACLE;
    p.ratio = 1.0f;
    tl_budget(&p, 101, &s, &w, &k);
    CHECK(s == 32 && w == 35 && k == 34);
}

/* the exact attention mass of every position for KV head g, in double */
static void naive_mass(const tl_model *m, const tl_state *s, int layer, int g, int n, double *mass)
{
    const tl_config *c = &m->config;
    int group = c->n_heads / c->n_kv_heads, j, i, d;
    for (i = 0; i < n; i++)
        mass[i] = 0.0;
    for (j = 0; j < group; j++) {
        int h = g * group + j;
        double max = -1e300, sum = 0.0, *sc = (double *)malloc((size_t)n * sizeof(double));
        for (i = 0; i < n; i++) {
            const float *k = tl_key_row(c, s, layer, i) + g * c->head_size;
            double dot = 0.0;
            for (d = 0; d < c->head_size; d++)
                dot += (double)s->q[h * c->head_size + d] * k[d];
            sc[i] = dot / sqrt((double)c->head_size);
            if (sc[i] > max)
                max = sc[i];
        }
        for (i = 0; i < n; i++)
            sum += exp(sc[i] - max);
        for (i = 0; i < n; i++)
            mass[i] += exp(sc[i] - max) / sum;
        free(sc);
    }
}

static void test_selection_contents(void)
{
    tl_config c = gen_config();
    tl_model m;
    tl_state s;
    tl_policy p;
    char err[TL_ERR_LEN];
    int pos, g, i, layer = 1, n = 40;
    double mass[64];
    CHECK(tl_write_random_checkpoint(tmp_path("sel.bin"), &c, 0, 5, err, sizeof err) == 0);
    CHECK(tl_build_model(&m, tmp_path("sel.bin"), err, sizeof err) == 0);
    CHECK(tl_build_state(&s, &m.config, 0, 1, err, sizeof err) == 0);
    for (pos = 0; pos < n - 1; pos++)
        CHECK(tl_forward_layers(&m, &s, NULL, pos % 50, pos) == 0);
    /* the stages by hand up to layer 1's selection at position n - 1 */
    tl_embed(&m, &s, 7);
    tl_layer_qkv(&m, &s, 0, n - 1);
    CHECK(tl_select(&m, &s, NULL, 0, n - 1) == 0);
    tl_layer_attention(&m, &s, 0, s.lists);
    tl_layer_ffn(&m, &s, 0);
    tl_layer_qkv(&m, &s, layer, n - 1);

    /* window: sinks 0..3, the last 18 (0.5 * 36) */
    tl_default_policy(&p, TL_ATTN_WINDOW);
    p.n_sink = 4;
    p.ratio = 0.5f;
    CHECK(tl_select(&m, &s, &p, layer, n - 1) == 0);
    for (g = 0; g < c.n_kv_heads; g++) {
        CHECK(s.lists[g].n == 22 && s.lists[g].k == NULL);
        for (i = 0; i < 4; i++)
            CHECK(s.lists[g].pos[i] == i);
        for (i = 4; i < 22; i++)
            CHECK(s.lists[g].pos[i] == 22 + (i - 4));
    }
    /* oracle: sinks, 9 exact top positions of 4..30, window 31..39 */
    p.mode = TL_ATTN_ORACLE;
    CHECK(tl_select(&m, &s, &p, layer, n - 1) == 0);
    for (g = 0; g < c.n_kv_heads; g++) {
        const tl_kv_list *l = &s.lists[g];
        double min_in = 1e300, max_out = -1e300;
        int chosen[64];
        memset(chosen, 0, sizeof chosen);
        CHECK(l->n == 4 + 9 + 9);
        for (i = 0; i < l->n; i++) {
            if (i > 0)
                CHECK(l->pos[i] > l->pos[i - 1]);
            if (l->pos[i] >= 0 && l->pos[i] < n)
                chosen[l->pos[i]] = 1;
        }
        for (i = 0; i < 4; i++)
            CHECK(chosen[i]);
        for (i = 31; i < 40; i++)
            CHECK(chosen[i]);
        naive_mass(&m, &s, layer, g, n, mass);
        for (i = 4; i < 31; i++) {
            if (chosen[i] && mass[i] < min_in)
                min_in = mass[i];
            if (!chosen[i] && mass[i] > max_out)
                max_out = mass[i];
        }
        CHECK(min_in >= max_out - 1e-6);
    }
    tl_free_state(&s);
    tl_free_model(&m);
}

/* A selection callback of the kind a KV-cache library provides: every
   position, with the rows gathered into its own buffer. */
typedef struct {
    float *k, *v;
    int calls;
} gather_ctx;

static int gather_all(void *user, const tl_model *m, tl_state *s, int layer, int pos,
                      tl_kv_list *lists)
{
    gather_ctx *gc = (gather_ctx *)user;
    const tl_config *c = &m->config;
    int g, i, hs = c->head_size;
    for (g = 0; g < c->n_kv_heads; g++) {
        float *k = gc->k + (size_t)g * (size_t)s->ctx * (size_t)hs;
        float *v = gc->v + (size_t)g * (size_t)s->ctx * (size_t)hs;
        for (i = 0; i <= pos; i++) {
            lists[g].pos[i] = i;
            memcpy(k + (size_t)i * (size_t)hs, tl_key_row(c, s, layer, i) + g * hs,
                   (size_t)hs * sizeof(float));
            memcpy(v + (size_t)i * (size_t)hs, tl_value_row(c, s, layer, i) + g * hs,
                   (size_t)hs * sizeof(float));
        }
        lists[g].n = pos + 1;
        lists[g].k = k;
        lists[g].v = v;
    }
    gc->calls++;
    return 0;
}

static void test_pqcache_placeholder_and_callback(void)
{
    tl_config c = gen_config();
    tl_model m;
    tl_policy p, full;
    tl_state s;
    gather_ctx gc;
    char err[TL_ERR_LEN];
    int np = 5, ns = 20;
    size_t n = (size_t)ns * 50;
    float *ref = (float *)malloc(n * sizeof(float)), *got = (float *)malloc(n * sizeof(float));
    tl_default_policy(&p, TL_ATTN_PQCACHE);
    CHECK(tl_check_policy(&p, err, sizeof err) != 0);
    CHECK(strcmp(err, "pqcache mode not built in this binary") == 0);
    CHECK(tl_write_random_checkpoint(tmp_path("pq.bin"), &c, 0, 8, err, sizeof err) == 0);
    CHECK(tl_build_model(&m, tmp_path("pq.bin"), err, sizeof err) == 0);
    CHECK(tl_build_state(&s, &m.config, 0, 1, err, sizeof err) == 0);
    CHECK(tl_forward(&m, &s, &p, 1, 0) == NULL);
    CHECK(strcmp(s.err, "pqcache mode not built in this binary") == 0);
    tl_free_state(&s);
    /* with a callback that gathers every row, the result is full attention */
    gc.k = (float *)malloc((size_t)(np + ns) * (size_t)m.config.kv_dim * sizeof(float));
    gc.v = (float *)malloc((size_t)(np + ns) * (size_t)m.config.kv_dim * sizeof(float));
    gc.calls = 0;
    p.select = gather_all;
    p.select_user = &gc;
    CHECK(tl_check_policy(&p, err, sizeof err) == 0);
    tl_default_policy(&full, TL_ATTN_FULL);
    CHECK(run_mode(&m, &full, 1, np, ns, ref) == 0);
    CHECK(run_mode(&m, &p, 1, np, ns, got) == 0);
    CHECK(gc.calls == ns * m.config.n_layers);
    CHECK(memcmp(ref, got, n * sizeof(float)) == 0);
    /* policy checks */
    tl_default_policy(&p, TL_ATTN_ORACLE);
    p.ratio = 1.5f;
    CHECK(tl_check_policy(&p, err, sizeof err) != 0);
    p.ratio = 0.1f;
    p.n_sink = -1;
    CHECK(tl_check_policy(&p, err, sizeof err) != 0);
    free(gc.k); free(gc.v); free(ref); free(got);
    tl_free_model(&m);
}

static void test_forward_rejects_bad_input(void)
{
    tl_config c = gen_config();
    tl_model m;
    tl_state s;
    char err[TL_ERR_LEN];
    CHECK(tl_write_random_checkpoint(tmp_path("bad.bin"), &c, 0, 2, err, sizeof err) == 0);
    CHECK(tl_build_model(&m, tmp_path("bad.bin"), err, sizeof err) == 0);
    CHECK(tl_build_state(&s, &m.config, 8, 1, err, sizeof err) == 0);
    CHECK(s.ctx == 8);
    CHECK(tl_forward(&m, &s, NULL, 50, 0) == NULL && strstr(s.err, "vocabulary"));
    CHECK(tl_forward(&m, &s, NULL, -1, 0) == NULL);
    CHECK(tl_forward(&m, &s, NULL, 1, 8) == NULL && strstr(s.err, "context"));
    CHECK(tl_forward(&m, &s, NULL, 1, 7) != NULL);
    tl_free_state(&s);
    tl_free_model(&m);
}

/* ----------------------------------------------------------------------------
   Tests: sampling and tokenizer */

/* counts[t] += how often t is drawn in n samples from logits {0, 0, log 2, log 4} */
static void draw_counts(tl_sampler *sp, int n, int counts[4])
{
    float logits[4];
    int i;
    for (i = 0; i < n; i++) {
        int t;
        logits[0] = 0.0f; logits[1] = 0.0f; /* the sampler may overwrite them */
        logits[2] = (float)log(2.0); logits[3] = (float)log(4.0);
        t = tl_sample(sp, logits);
        if (t >= 0 && t < 4)
            counts[t]++;
    }
}

static void test_sampler(void)
{
    tl_sampler sp;
    float logits[4];
    int i, counts[4] = { 0, 0, 0, 0 };
    unsigned long long a = tl_rng_seed(5), b = tl_rng_seed(5);
    CHECK(tl_rng_next(&a) == tl_rng_next(&b));
    CHECK(tl_build_sampler(&sp, 4, 0.0f, 0.9f, 1) == 0);
    logits[0] = 0.1f; logits[1] = 2.0f; logits[2] = -1.0f; logits[3] = 1.9f;
    CHECK(tl_sample(&sp, logits) == 1);
    tl_free_sampler(&sp);
    /* temperature 1, no top-p: probabilities 1/8, 1/8, 1/4, 1/2 */
    CHECK(tl_build_sampler(&sp, 4, 1.0f, 1.0f, 1) == 0);
    draw_counts(&sp, 8000, counts);
    CHECK(counts[3] > 3700 && counts[3] < 4300);
    CHECK(counts[2] > 1750 && counts[2] < 2250);
    CHECK(counts[0] > 800 && counts[0] < 1200);
    tl_free_sampler(&sp);
    /* top-p 0.6: only tokens 3 (0.5) and 2 (0.25) */
    CHECK(tl_build_sampler(&sp, 4, 1.0f, 0.6f, 2) == 0);
    memset(counts, 0, sizeof counts);
    draw_counts(&sp, 3000, counts);
    CHECK(counts[0] == 0 && counts[1] == 0);
    CHECK(counts[3] > 1800 && counts[3] < 2200);
    tl_free_sampler(&sp);
    /* top-p tiny: always the most likely */
    CHECK(tl_build_sampler(&sp, 4, 1.0f, 1e-6f, 3) == 0);
    for (i = 0; i < 100; i++) {
        logits[0] = 0.0f; logits[1] = 3.0f; logits[2] = 0.5f; logits[3] = 2.9f;
        CHECK(tl_sample(&sp, logits) == 1);
    }
    tl_free_sampler(&sp);
}

static int write_tokenizer(const char *path, int *vocab_size)
{
    FILE *f = fopen(path, "wb");
    int max_len = 8, i;
    char piece[16];
    const char *extra[] = { " ", "a", "b", "ab", " ab", "c", "\xc3\xa9" };
    float extra_score[] = { -1.0f, -2.0f, -2.0f, 1.0f, 2.0f, -2.0f, -3.0f };
    if (!f)
        return -1;
    fwrite(&max_len, 4, 1, f);
    for (i = 0; i < 3 + 256 + 7; i++) {
        float score = 0.0f;
        int len;
        if (i == 0) strcpy(piece, "<unk>");
        else if (i == 1) strcpy(piece, "\n<s>\n");
        else if (i == 2) strcpy(piece, "\n</s>\n");
        else if (i < 259) snprintf(piece, sizeof piece, "<0x%02X>", i - 3);
        else {
            strcpy(piece, extra[i - 259]);
            score = extra_score[i - 259];
        }
        len = (int)strlen(piece);
        fwrite(&score, 4, 1, f);
        fwrite(&len, 4, 1, f);
        fwrite(piece, 1, (size_t)len, f);
    }
    *vocab_size = 3 + 256 + 7;
    return fclose(f);
}

static void test_tokenizer(void)
{
    tl_tokenizer t;
    char err[TL_ERR_LEN];
    int vocab = 0, tokens[32], n = 0;
    CHECK(write_tokenizer(tmp_path("tok.bin"), &vocab) == 0);
    CHECK(tl_build_tokenizer(&t, tmp_path("tok.bin"), vocab, err, sizeof err) == 0);
    /* " " a b " " c -> " " ab " " c -> " ab" " " c */
    CHECK(tl_encode(&t, "ab c", 1, 0, tokens, &n) == 0);
    CHECK(n == 4 && tokens[0] == 1 && tokens[1] == 263 && tokens[2] == 259 && tokens[3] == 264);
    CHECK(strcmp(tl_decode(&t, 1, 263), "ab") == 0);      /* first word loses its space */
    CHECK(strcmp(tl_decode(&t, 5, 263), " ab") == 0);
    /* a known code point, and unknown bytes falling back to <0xNN> tokens */
    CHECK(tl_encode(&t, "\xc3\xa9\xe2\x82\xac", 0, 1, tokens, &n) == 0);
    CHECK(n == 6 && tokens[0] == 259 && tokens[1] == 265 && tokens[2] == 3 + 0xe2 &&
          tokens[3] == 3 + 0x82 && tokens[4] == 3 + 0xac && tokens[5] == 2);
    CHECK(strcmp(tl_decode(&t, 0, 3 + 0x41), "A") == 0);
    CHECK(tl_decode(&t, 0, 3 + 0xe2)[0] == '\xe2');
    CHECK(strcmp(tl_decode(&t, 0, 9999), "") == 0);
    CHECK(tl_encode(&t, "", 1, 0, tokens, &n) == 0 && n == 1 && tokens[0] == 1);
    tl_free_tokenizer(&t);
    /* a vocabulary larger than the file holds is an error, not a crash */
    CHECK(tl_build_tokenizer(&t, tmp_path("tok.bin"), vocab + 1, err, sizeof err) != 0);
    /* a vocabulary the file's size cannot hold is refused before allocating */
    err[0] = '\0';
    CHECK(tl_build_tokenizer(&t, tmp_path("tok.bin"), 1 << 30, err, sizeof err) != 0);
    CHECK(strstr(err, "cannot hold 1073741824 tokens") != NULL && t.vocab == NULL);
    CHECK(tl_build_tokenizer(&t, tmp_path("nope.bin"), vocab, err, sizeof err) != 0);
}

/* A tokenizer file of the given pieces and scores (max_token_length 8). */
static int write_pieces(const char *path, const char *const *pieces, const float *scores, int n)
{
    FILE *f = fopen(path, "wb");
    int max_len = 8, i;
    if (!f)
        return -1;
    fwrite(&max_len, 4, 1, f);
    for (i = 0; i < n; i++) {
        int len = (int)strlen(pieces[i]);
        fwrite(&scores[i], 4, 1, f);
        fwrite(&len, 4, 1, f);
        fwrite(pieces[i], 1, (size_t)len, f);
    }
    return fclose(f);
}

/* <s> is a marker, not text: it stays first even when its piece joined to
   the next one spells a token (an empty piece for <s> joins with anything) */
static void test_tokenizer_keeps_bos(void)
{
    const char *pieces[] = { "<unk>", "", "</s>", "a", "b", "ab", " ", "x", "xa" };
    const float scores[] = { 0.0f, 0.0f, 0.0f, -1.0f, -1.0f, 1.0f, -1.0f, -1.0f, 5.0f };
    tl_tokenizer t;
    char err[TL_ERR_LEN];
    int tokens[16], n = -1;
    CHECK(write_pieces(tmp_path("tok_bos.bin"), pieces, scores, 9) == 0);
    CHECK(tl_build_tokenizer(&t, tmp_path("tok_bos.bin"), 9, err, sizeof err) == 0);
    /* " " a b -> " " ab; <s> stays in front */
    CHECK(tl_encode(&t, "ab", 1, 1, tokens, &n) == 0);
    CHECK(n == 4 && tokens[0] == TL_BOS && tokens[1] == 6 && tokens[2] == 5 && tokens[3] == TL_EOS);
    /* without <s>, the same pieces merge as before */
    CHECK(tl_encode(&t, "xa", 0, 0, tokens, &n) == 0);
    CHECK(n == 2 && tokens[0] == 6 && tokens[1] == 8);
    tl_free_tokenizer(&t);
    /* <s> spelled "x" and no dummy prefix (" " is "y" now): "x" + "a" would
       be "xa", the best-scored merge */
    pieces[1] = "x";
    pieces[6] = "y";
    CHECK(write_pieces(tmp_path("tok_bos2.bin"), pieces, scores, 9) == 0);
    CHECK(tl_build_tokenizer(&t, tmp_path("tok_bos2.bin"), 9, err, sizeof err) == 0);
    CHECK(tl_encode(&t, "a", 1, 0, tokens, &n) == 0);
    CHECK(n == 2 && tokens[0] == TL_BOS && tokens[1] == 3);
    tl_free_tokenizer(&t);
}

/* A vocabulary without room for the ids of <s> (1) and </s> (2) is refused
   when the tokenizer is read, and tl_encode refuses a tokenizer built by
   hand with one (it would look up the pieces of ids past the end). */
static void test_tokenizer_too_small(void)
{
    tl_tokenizer t;
    char err[TL_ERR_LEN];
    char piece_a[] = "a", piece_b[] = "b";
    char *vocab[2];
    float scores[2] = { 0.0f, 0.0f };
    tl_token_index sorted[2];
    int full = 0, tokens[16], n = -1, size;
    CHECK(write_tokenizer(tmp_path("tok_small.bin"), &full) == 0);
    for (size = -1; size < 3; size++) {
        err[0] = '\0';
        CHECK(tl_build_tokenizer(&t, tmp_path("tok_small.bin"), size, err, sizeof err) != 0);
        CHECK(strstr(err, "too small") != NULL);
        CHECK(t.vocab == NULL && t.vocab_size == 0);
    }
    CHECK(tl_build_tokenizer(&t, tmp_path("tok_small.bin"), 3, err, sizeof err) == 0);
    /* three tokens are enough: the bytes of "ab" fall back to <unk> (0) */
    CHECK(tl_encode(&t, "ab", 1, 1, tokens, &n) == 0 && n == 4 && tokens[0] == TL_BOS &&
          tokens[1] == 0 && tokens[2] == 0 && tokens[3] == TL_EOS);
    tl_free_tokenizer(&t);

    vocab[0] = piece_a;
    vocab[1] = piece_b;
    sorted[0].str = piece_a;
    sorted[0].id = 0;
    sorted[1].str = piece_b;
    sorted[1].id = 1;
    memset(&t, 0, sizeof t);
    t.max_token_length = 1;
    t.vocab = vocab;
    t.scores = scores;
    t.sorted = sorted;
    for (size = 1; size <= 2; size++) {
        t.vocab_size = size;
        n = -1;
        CHECK(tl_encode(&t, "ab", 1, 1, tokens, &n) != 0 && n == 0);
        n = -1;
        CHECK(tl_encode(&t, "a", 0, 0, tokens, &n) != 0 && n == 0);
    }
    /* an empty (freed or failed) tokenizer encodes nothing */
    memset(&t, 0, sizeof t);
    CHECK(tl_encode(&t, "a", 1, 0, tokens, &n) != 0 && n == 0);
}

/* The loaders read regular files only; a named pipe must not block them (it
   would wait for a writer forever), and a device or directory is refused. */
static void test_loaders_refuse_non_regular_files(void)
{
    tl_model m;
    tl_tokenizer t;
    char err[TL_ERR_LEN];
    const char *fifo = tmp_path("pipe");
    double t0 = tl_time_s();
    CHECK(mkfifo(fifo, 0600) == 0);
    err[0] = '\0';
    CHECK(tl_build_model(&m, fifo, err, sizeof err) != 0);
    CHECK(strstr(err, "named pipe") != NULL && strstr(err, "not a regular file") != NULL);
    CHECK(m.map == NULL);
    err[0] = '\0';
    CHECK(tl_build_tokenizer(&t, fifo, 300, err, sizeof err) != 0);
    CHECK(strstr(err, "named pipe") != NULL && t.vocab == NULL);
    /* a directory */
    err[0] = '\0';
    CHECK(tl_build_model(&m, g_dir, err, sizeof err) != 0 && strstr(err, "directory") != NULL);
    err[0] = '\0';
    CHECK(tl_build_tokenizer(&t, g_dir, 300, err, sizeof err) != 0 &&
          strstr(err, "directory") != NULL);
    /* character devices: /dev/null reads as empty, /dev/zero as an endless
       run of zeros (which would make a tokenizer of empty tokens) */
    if (access("/dev/null", R_OK) == 0) {
        err[0] = '\0';
        CHECK(tl_build_model(&m, "/dev/null", err, sizeof err) != 0 &&
              strstr(err, "character device") != NULL);
        err[0] = '\0';
        CHECK(tl_build_tokenizer(&t, "/dev/null", 300, err, sizeof err) != 0 &&
              strstr(err, "character device") != NULL);
    }
    if (access("/dev/zero", R_OK) == 0) {
        err[0] = '\0';
        CHECK(tl_build_model(&m, "/dev/zero", err, sizeof err) != 0 &&
              strstr(err, "character device") != NULL);
        err[0] = '\0';
        CHECK(tl_build_tokenizer(&t, "/dev/zero", 300, err, sizeof err) != 0 &&
              strstr(err, "character device") != NULL);
    }
    /* a missing file still says why */
    err[0] = '\0';
    CHECK(tl_build_model(&m, tmp_path("missing.bin"), err, sizeof err) != 0 &&
          strstr(err, "cannot open") != NULL);
    CHECK(tl_time_s() - t0 < 10.0);
}

/* A state without the host KV cache has no rows to point at (tl_key_row and
   tl_value_row give NULL, tl_select refuses it), and attention over explicit
   rows (krow, vrow) on it gives the logits of full attention over the host
   cache exactly. */
static void test_explicit_rows_without_kv_cache(void)
{
    spec sp = small_spec();
    tl_model m;
    tl_state full, bare;
    tl_policy pol;
    char err[TL_ERR_LEN];
    const tl_config *c;
    enum { N = 12 };
    float *keys = NULL, *vals = NULL;
    const void **krow = NULL, **vrow = NULL;
    int pos, l, g, i, same = 1;
    size_t row;

    CHECK(write_spec(tmp_path("rows.bin"), &sp) == 0);
    if (tl_build_model(&m, tmp_path("rows.bin"), err, sizeof err) != 0) {
        printf("  %s\n", err);
        g_failed_now = 1;
        return;
    }
    c = &m.config;
    CHECK(tl_build_state(&full, c, N, 1, err, sizeof err) == 0);
    CHECK(tl_build_state_ex(&bare, c, N, 1, TL_STATE_NO_KV_CACHE, err, sizeof err) == 0);
    CHECK(bare.key_cache == NULL && bare.value_cache == NULL);
    CHECK(tl_key_row(c, &bare, 0, 0) == NULL && tl_value_row(c, &bare, 1, 3) == NULL);
    CHECK(tl_key_row(c, &full, 1, 3) == full.key_cache + (size_t)(N + 3) * (size_t)c->kv_dim);
    tl_default_policy(&pol, TL_ATTN_WINDOW);
    bare.err[0] = '\0';
    CHECK(tl_select(&m, &bare, NULL, 0, 0) != 0 && strstr(bare.err, "no KV cache") != NULL);
    CHECK(tl_select(&m, &bare, &pol, 0, 0) != 0);

    row = (size_t)c->kv_dim;
    keys = (float *)calloc((size_t)c->n_layers * N * row, sizeof(float));
    vals = (float *)calloc((size_t)c->n_layers * N * row, sizeof(float));
    krow = (const void **)calloc((size_t)c->n_kv_heads * N, sizeof(void *));
    vrow = (const void **)calloc((size_t)c->n_kv_heads * N, sizeof(void *));
    CHECK(keys && vals && krow && vrow);
    for (pos = 0; keys && vals && krow && vrow && pos < N; pos++) {
        int token = (pos * 7 + 3) % c->vocab_size;
        float *want = tl_forward(&m, &full, NULL, token, pos), *got;
        if (!want) {
            printf("  forward: %s\n", full.err);
            same = 0;
            break;
        }
        tl_embed(&m, &bare, token);
        for (l = 0; l < c->n_layers; l++) {
            float *k = keys + ((size_t)l * N) * row, *v = vals + ((size_t)l * N) * row;
            tl_layer_qkv_rows(&m, &bare, l, pos, k + (size_t)pos * row, v + (size_t)pos * row);
            for (g = 0; g < c->n_kv_heads; g++) {
                tl_kv_list *lst = &bare.lists[g];
                for (i = 0; i <= pos; i++) {
                    lst->pos[i] = i;
                    krow[g * N + i] = k + (size_t)i * row + (size_t)g * (size_t)c->head_size;
                    vrow[g * N + i] = v + (size_t)i * row + (size_t)g * (size_t)c->head_size;
                }
                lst->n = pos + 1;
                lst->k = lst->v = NULL;
                lst->krow = krow + g * N;
                lst->vrow = vrow + g * N;
            }
            tl_layer_attention(&m, &bare, l, bare.lists);
            tl_layer_ffn(&m, &bare, l);
        }
        got = tl_classify(&m, &bare);
        same &= memcmp(want, got, (size_t)c->vocab_size * sizeof(float)) == 0;
    }
    CHECK(same);
    free(keys);
    free(vals);
    free(krow);
    free(vrow);
    tl_free_state(&full);
    tl_free_state(&bare);
    tl_free_model(&m);
}

/* ----------------------------------------------------------------------------
   Projection kernels: the SIMD versions (where the CPU has them) against the
   portable dot products, to the bit, for every stored type and for lengths
   with and without a tail */

static unsigned long long g_kseed = 12345;

static unsigned kernel_rand(void)
{
    g_kseed = g_kseed * 6364136223846793005ULL + 1442695040888963407ULL;
    return (unsigned)(g_kseed >> 33);
}

/* a random normal number of the type: bf16, fp16 (exponents near 1) or fp32 */
static void random_elems(void *dst, int dtype, int count)
{
    int i;
    for (i = 0; i < count; i++) {
        unsigned r = kernel_rand();
        if (dtype == TL_BF16)
            ((unsigned short *)dst)[i] = (unsigned short)((r & 0x8000u) | ((120u + r % 10u) << 7) | (r >> 8 & 0x7fu));
        else if (dtype == TL_F16)
            ((unsigned short *)dst)[i] = (unsigned short)((r & 0x8000u) | ((10u + r % 10u) << 10) | (r >> 8 & 0x3ffu));
        else
            ((float *)dst)[i] = ((float)(r % 20001u) - 10000.0f) / 7919.0f;
    }
}

static void test_kernels_match_portable(void)
{
    static const int lens[] = { 8, 13, 64, 71, 2053 };
    static const int types[] = { TL_F32, TL_BF16, TL_F16 };
    int li, ti, r, k;
    for (li = 0; li < 5; li++)
        for (ti = 0; ti < 3; ti++) {
            int n = lens[li], dt = types[ti], rows = 7;
            size_t es = dt == TL_F32 ? 4u : 2u;
            unsigned char *w = (unsigned char *)malloc((size_t)rows * (size_t)n * es);
            float *x = (float *)malloc((size_t)n * 5 * sizeof(float)), *out = (float *)malloc((size_t)rows * sizeof(float));
            float *row32 = (float *)malloc((size_t)n * sizeof(float));
            tl_mat m;
            CHECK(w && x && out && row32);
            if (!w || !x || !out || !row32) {
                free(w); free(x); free(out); free(row32);
                return;
            }
            random_elems(w, dt, rows * n);
            random_elems(x, TL_F32, 5 * n);
            m.data = w;
            m.dtype = dt;
            tl__rows(&m, n, x, out, 0, rows);   /* four rows at a time, then three */
            for (r = 0; r < rows; r++) {
                const unsigned char *row = w + (size_t)r * (size_t)n * es;
                float want;
                for (k = 0; k < n; k++)
                    row32[k] = tl__elem(row, dt, (size_t)k);
                want = tl__dot_scalar(row32, x, n);
                CHECK(memcmp(&out[r], &want, sizeof want) == 0);
                CHECK(out[r] == tl__dot_row(row, dt, x, n));
            }
            {   /* the prefill products: two rows with four inputs, one row with four */
                const float *b[4];
                float o8[8], o4[4], a1[4096];
                for (k = 0; k < 4; k++)
                    b[k] = x + (size_t)(k + 1) * (size_t)n;
                for (k = 0; k < n; k++)
                    a1[k] = tl__elem(w + (size_t)n * es, dt, (size_t)k);
                for (k = 0; k < n; k++)
                    row32[k] = tl__elem(w, dt, (size_t)k);
                tl__dot_2x4(row32, a1, b, n, o8);
                tl__dot_1x4(row32, b, n, o4);
                for (k = 0; k < 4; k++) {
                    float w0 = tl__dot_scalar(row32, b[k], n), w1 = tl__dot_scalar(a1, b[k], n);
                    CHECK(memcmp(&o8[k], &w0, sizeof w0) == 0);
                    CHECK(memcmp(&o8[4 + k], &w1, sizeof w1) == 0);
                    CHECK(memcmp(&o4[k], &w0, sizeof w0) == 0);
                    CHECK(tl__dot(row32, b[k], n) == w0);
                }
            }
            free(w); free(x); free(out); free(row32);
        }
}

/* Decode attention over the host cache (every head the same positions, read
   together for the heads of a thread) and over rows given one by one, for
   head sizes that use each part of the kernels and lengths with partial
   blocks, against the portable loops: scores by tl__dot_scalar, tl_softmax,
   then out += a * v row by row. All to the bit. */
static void test_attention_kernels_match_portable(void)
{
    static const int head_sizes[] = { 8, 24, 64, 96, 128 };
    static const int lens[] = { 1, 7, 8, 33, 70 };
    int hi, li, threads;
    for (hi = 0; hi < 5; hi++)
        for (li = 0; li < 5; li++)
            for (threads = 1; threads <= 2; threads++) {
                tl_model m;
                tl_state st;
                tl__attn_job jobs[2];
                tl_config *c = &m.config;
                char err[TL_ERR_LEN];
                int n = lens[li], hs = head_sizes[hi], g, i, j, e, t, same_cache = 1, same_rows = 1;
                float *att = NULL, *want = NULL, *rows_k = NULL, *rows_v = NULL;
                float scale = 1.0f / sqrtf((float)hs);
                memset(&m, 0, sizeof m);
                c->n_layers = 2; c->n_heads = 8; c->n_kv_heads = 4; c->head_size = hs;
                c->dim = c->n_heads * hs; c->hidden_dim = 16; c->vocab_size = 16; c->seq_len = 128;
                c->rope_theta = 10000.0f; c->arch = TL_ARCH_LLAMA; c->rope_layout = TL_ROPE_HALF;
                CHECK(tl_check_config(c, err, sizeof err) == 0);
                if (tl_build_state(&st, c, n, threads, err, sizeof err) != 0) {
                    printf("  %s\n", err);
                    g_failed_now = 1;
                    return;
                }
                random_elems(st.key_cache, TL_F32, c->n_layers * n * c->kv_dim);
                random_elems(st.value_cache, TL_F32, c->n_layers * n * c->kv_dim);
                random_elems(st.q, TL_F32, c->q_dim);
                att = (float *)malloc((size_t)n * sizeof(float));
                want = (float *)calloc((size_t)c->q_dim, sizeof(float));
                rows_k = (float *)malloc((size_t)c->n_kv_heads * (size_t)n * (size_t)hs * sizeof(float));
                rows_v = (float *)malloc((size_t)c->n_kv_heads * (size_t)n * (size_t)hs * sizeof(float));
                CHECK(att && want && rows_k && rows_v);
                if (!att || !want || !rows_k || !rows_v) {
                    free(att); free(want); free(rows_k); free(rows_v);
                    tl_free_state(&st);
                    return;
                }
                for (g = 0; g < c->n_kv_heads; g++)          /* the portable loops, layer 1 */
                    for (j = 0; j < c->n_heads / c->n_kv_heads; j++) {
                        int h = g * (c->n_heads / c->n_kv_heads) + j;
                        for (i = 0; i < n; i++)
                            att[i] = tl__dot_scalar(st.q + (size_t)h * (size_t)hs,
                                                    tl_key_row(c, &st, 1, i) + (size_t)g * (size_t)hs, hs) * scale;
                        tl_softmax(att, n);
                        for (i = 0; i < n; i++)
                            for (e = 0; e < hs; e++)
                                want[(size_t)h * (size_t)hs + (size_t)e] +=
                                    att[i] * tl_value_row(c, &st, 1, i)[(size_t)g * (size_t)hs + (size_t)e];
                    }
                for (g = 0; g < c->n_kv_heads; g++) {         /* every head: positions 0 .. n-1 */
                    for (i = 0; i < n; i++)
                        st.lists[g].pos[i] = i;
                    st.lists[g].n = n;
                    st.lists[g].k = st.lists[g].v = NULL;
                    st.lists[g].krow = st.lists[g].vrow = NULL;
                }
                for (t = 0; t < threads; t++) {
                    jobs[t].m = &m;
                    jobs[t].s = &st;
                    jobs[t].layer = 1;
                    jobs[t].g0 = c->n_kv_heads * t / threads;
                    jobs[t].g1 = c->n_kv_heads * (t + 1) / threads;
                    jobs[t].lists = st.lists;
                }
                if (threads > 1 && st.pool)
                    tl_parallel(&st, tl__attn_part, jobs);   /* the state's pool */
                else
                    for (t = 0; t < threads; t++)
                        tl__attn_worker(&jobs[t]);
                same_cache = memcmp(st.xb, want, (size_t)c->q_dim * sizeof(float)) == 0;
                memset(st.xb, 0, (size_t)c->q_dim * sizeof(float));
                for (g = 0; g < c->n_kv_heads; g++) {         /* the same rows, copied out per head */
                    float *kg = rows_k + (size_t)g * (size_t)n * (size_t)hs, *vg = rows_v + (size_t)g * (size_t)n * (size_t)hs;
                    for (i = 0; i < n; i++) {
                        memcpy(kg + (size_t)i * (size_t)hs, tl_key_row(c, &st, 1, i) + (size_t)g * (size_t)hs, (size_t)hs * sizeof(float));
                        memcpy(vg + (size_t)i * (size_t)hs, tl_value_row(c, &st, 1, i) + (size_t)g * (size_t)hs, (size_t)hs * sizeof(float));
                    }
                    st.lists[g].k = kg;
                    st.lists[g].v = vg;
                }
                for (t = 0; t < threads; t++)
                    tl__attn_worker(&jobs[t]);
                same_rows = memcmp(st.xb, want, (size_t)c->q_dim * sizeof(float)) == 0;
                if (!same_cache || !same_rows)
                    printf("  head size %d, %d rows, %d thread(s): cache %s, rows %s\n", hs, n, threads,
                           same_cache ? "same" : "DIFFERENT", same_rows ? "same" : "DIFFERENT");
                CHECK(same_cache && same_rows);
                free(att); free(want); free(rows_k); free(rows_v);
                tl_free_state(&st);
            }
}

/* ----------------------------------------------------------------------------
   Main */

static void remove_dir(void)
{
    DIR *d = opendir(g_dir);
    struct dirent *e;
    char path[1200];
    if (!d)
        return;
    while ((e = readdir(d)) != NULL) {   /* only files this program wrote */
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        snprintf(path, sizeof path, "%s/%s", g_dir, e->d_name);
        unlink(path);
    }
    closedir(d);
    rmdir(g_dir);
}

int main(void)
{
    const char *tmp = getenv("TMPDIR");
    snprintf(g_dir, sizeof g_dir, "%s/tiny_llama_test_XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(g_dir)) {
        printf("cannot create a temporary directory\n0 passed, 1 failed\n");
        return 1;
    }
    run_test("valid checkpoints load", test_valid_checkpoints_load);
    run_test("truncated and oversized files are rejected", test_truncated_and_oversized);
    run_test("corrupted headers are rejected", test_corrupted_headers);
    run_test("header parsing and sizes", test_parse_header_direct);
    run_test("full forward matches the reference", test_forward_matches_reference);
    run_test("random checkpoint generator", test_generator);
    run_test("window and oracle with full budget equal full", test_modes_with_full_budget_equal_full);
    run_test("budget split", test_budget);
    run_test("window and oracle selections", test_selection_contents);
    run_test("pqcache placeholder and selection callback", test_pqcache_placeholder_and_callback);
    run_test("forward rejects bad tokens and positions", test_forward_rejects_bad_input);
    run_test("sampler", test_sampler);
    run_test("tokenizer", test_tokenizer);
    run_test("tokenizer refuses a vocabulary too small for <s> and </s>", test_tokenizer_too_small);
    run_test("tokenizer keeps <s> first", test_tokenizer_keeps_bos);
    run_test("loaders refuse pipes, devices and directories", test_loaders_refuse_non_regular_files);
    run_test("explicit rows need no host KV cache", test_explicit_rows_without_kv_cache);
    run_test("projection kernels equal the portable dot products to the bit", test_kernels_match_portable);
    run_test("attention kernels equal the portable loops to the bit", test_attention_kernels_match_portable);
    remove_dir();
    return test_summary();
}
