/* fuzz_calib.c - libFuzzer target for the library's files: the scheduler's calibration
   file (pqc_scheduler_load, pqc_scheduler_save) and, when byte 1 is 128 or more, the
   quantizer file (pqc_pq_load, pqc_pq_save; byte 1 < 192) or the cache file
   (pqc_cache_load, pqc_cache_save, into the small cache of fz_cache_desc; byte 1 >= 192).

   Input layout:
     byte 0  how the rest reaches pqc_scheduler_load (low 3 bits):
               0, 5: the rest, byte for byte, is the file
               1, 6: the rest is the file's body; a correct "check" line (FNV-1a 64 of the
                     body, as the format has it) is appended, so that mutations reach
                     the parser behind the checksum
               2: the path is a directory      3: the path is a FIFO nobody writes to
               4: the path names no file       7: an empty path, then null arguments
     byte 1  the scheduler before the load: 0 mod 3 = no fit; 1 = a fit measured from
             samples; 2 = a fit set with pqc_scheduler_set_fit. 128 or more: the input
             is a quantizer file instead (modes as above; for 1 and 6 the file's 8-byte
             checksum is appended, little-endian, so that mutations pass it: FNV-1a 64
             for a quantizer file, the word-wise FNV-1a 64 of the format for a cache file);
             a failed pqc_pq_load must leave its output untouched, a successful one must
             give a consistent quantizer that saves and loads back bit for bit; a failed
             pqc_cache_load likewise, a loaded cache must select, append, select again
             and save
   Checks: a result is PQC_SUCCESS or a negative pqc_result, a failure sets
   pqc_last_error(); a load returns within 2 s (a FIFO must not be waited on); a failed
   load leaves pqc_scheduler_get_fit as it was; a successful load yields finite
   coefficients with b1 > 0 and samples behind both lines, the file saved from it loads
   back to the same fit, bit for bit, and the iteration count stays in range. A
   violation prints "FUZZ CHECK FAILED" and aborts. */
#define _POSIX_C_SOURCE 200809L
#define PQCACHE_IMPLEMENTATION
#include "../../pqcache.h"
#include "cache_checksum.h"
#include "fuzz/fuzz_util.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char *g_dir, *g_file, *g_saved, *g_fifo; /* in the scratch directory */
static char g_missing[600];
static char g_sentinel[600];

static void fz_fail(const char *what, pqc_result r)
{
    fprintf(stderr, "FUZZ CHECK FAILED: fuzz_calib: %s (result %d, last error \"%s\")\n", what, (int)r,
            pqc_last_error());
    abort();
}

/* one scratch directory per process (fuzz_util.h), with a FIFO in it */
static void fz_setup(void)
{
    if (g_dir) return;
    g_dir = fz_scratch_dir("fuzz_calib");
    g_file = fz_scratch_path("fuzz_calib", "input.txt");
    g_saved = fz_scratch_path("fuzz_calib", "saved.txt");
    g_fifo = fz_scratch_path("fuzz_calib", "fifo");
    snprintf(g_missing, sizeof g_missing, "%s/missing/none.txt", g_dir);
    if (mkfifo(g_fifo, 0600) != 0) {
        perror("fuzz_calib: mkfifo");
        abort();
    }
    /* the message a failing call must replace */
    (void)pqc_topk(NULL, NULL, 0, 0, NULL, NULL, NULL);
    snprintf(g_sentinel, sizeof g_sentinel, "%s", pqc_last_error());
}

/* FNV-1a, 64 bits */
static uint64_t fz_fnv(const unsigned char *p, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull;
    size_t i;
    for (i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

static int fz_write(const char *path, const unsigned char *p, size_t n, int with_check)
{
    FILE *fp = fopen(path, "wb");
    if (!fp) return 0;
    if (n && fwrite(p, 1, n, fp) != n) {
        fclose(fp);
        return 0;
    }
    if (with_check) fprintf(fp, "check %016llx\n", (unsigned long long)fz_fnv(p, n));
    return fclose(fp) == 0;
}

static void fz_arm(void) { (void)pqc_topk(NULL, NULL, 0, 0, NULL, NULL, NULL); }

static double fz_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static pqc_result fz_expect(pqc_result r, const char *call)
{
    const char *m;
    if (r > 0 || r < PQC_ERROR_UNSUPPORTED) fz_fail(call, r);
    if (r == PQC_SUCCESS) return r;
    m = pqc_last_error();
    if (!m || !*m || strcmp(m, g_sentinel) == 0) fz_fail("failed without setting pqc_last_error()", r);
    return r;
}

static int fz_same_fit(const pqc_scheduler_fit *a, const pqc_scheduler_fit *b)
{
    return !memcmp(&a->a1, &b->a1, sizeof a->a1) && !memcmp(&a->b1, &b->b1, sizeof a->b1) &&
           !memcmp(&a->a2, &b->a2, sizeof a->a2) && !memcmp(&a->b2, &b->b2, sizeof a->b2) &&
           !memcmp(&a->g2, &b->g2, sizeof a->g2) && a->n1 == b->n1 && a->n2 == b->n2;
}

static int fz_finite_fit(const pqc_scheduler_fit *f)
{
    return isfinite(f->a1) && isfinite(f->b1) && isfinite(f->a2) && isfinite(f->b2) && isfinite(f->g2);
}

/* the scheduler's state before the load */
static pqc_scheduler *fz_scheduler(unsigned how)
{
    pqc_scheduler *s = NULL;
    if (fz_expect(pqc_scheduler_create(NULL, &s), "pqc_scheduler_create") != PQC_SUCCESS || !s)
        fz_fail("pqc_scheduler_create with defaults failed", PQC_SUCCESS);
    if (how % 3 == 1) {
        int i;
        for (i = 1; i <= 4; i++) {
            fz_expect(pqc_scheduler_add_kmeans(s, 4096.0 * i, 10, 0.002 * i + 0.001), "pqc_scheduler_add_kmeans");
            fz_expect(pqc_scheduler_add_compute(s, 4096.0 * i, 0.01 * i + 0.0004 * i * i + 0.003),
                      "pqc_scheduler_add_compute");
        }
    } else if (how % 3 == 2) {
        pqc_scheduler_fit f;
        memset(&f, 0, sizeof f);
        f.a1 = 1e-3;
        f.b1 = 5e-9;
        f.a2 = 2e-3;
        f.b2 = 1e-6;
        f.g2 = 3e-12;
        f.n1 = 7;
        f.n2 = 9;
        if (fz_expect(pqc_scheduler_set_fit(s, &f), "pqc_scheduler_set_fit") != PQC_SUCCESS)
            fz_fail("pqc_scheduler_set_fit of a valid fit failed", PQC_SUCCESS);
    }
    return s;
}

/* the cache every cache file is loaded into: 1 layer, 2 KV heads, 4 query heads, d_h 8,
   m 2, 2 bits, 2 sinks, outlier lists of 2, residual-aware scoring, fp16 */
static pqc_cache_desc fz_cache_desc(void)
{
    pqc_cache_desc d;
    memset(&d, 0, sizeof d);
    d.n_layers = 1;
    d.n_kv_heads = 2;
    d.n_q_heads = 4;
    d.head_dim = 8;
    d.kv_dtype = PQC_F16;
    d.max_tokens = 512;
    d.n_sink = 2;
    d.budget_ratio = 0.3;
    d.pq.m = 2;
    d.pq.bits = 2;
    d.pq.iters = 2;
    d.pq.seed = 1;
    d.outliers = 2;
    d.residual_weight = 0.15;
    d.rerank = 2;
    d.cache_blocks = 2;
    d.block_tokens = 4;
    return d;
}

static void fz_cache_file(const char *path)
{
    pqc_cache_desc d = fz_cache_desc();
    pqc_cache *c = (pqc_cache *)&d;
    pqc_selection sel;
    pqc_result r;
    float q[4 * 8], kv[2 * 8];
    int i;
    fz_arm();
    r = fz_expect(pqc_cache_load(NULL, &d, path, &c), "pqc_cache_load");
    if (r != PQC_SUCCESS) {
        if (c != (pqc_cache *)&d) fz_fail("a failed pqc_cache_load wrote its output", r);
        return;
    }
    for (i = 0; i < 32; i++) q[i] = (float)(i % 5) - 2.0f;
    for (i = 0; i < 16; i++) kv[i] = (float)(i % 3) - 1.0f;
    if (pqc_cache_tokens(c, 0) > 0) {
        if (fz_expect(pqc_selection_init(c, &sel), "pqc_selection_init") == PQC_SUCCESS) {
            fz_expect(pqc_cache_select(c, 0, q, &sel), "pqc_cache_select");
            fz_expect(pqc_cache_append(c, 0, kv, kv), "pqc_cache_append");
            fz_expect(pqc_cache_select(c, 0, q, &sel), "pqc_cache_select");
            pqc_selection_free(&sel);
        }
    }
    fz_expect(pqc_cache_save(c, g_saved), "pqc_cache_save");
    pqc_cache_destroy(c);
}

static void fz_file(unsigned mode, const unsigned char *body, size_t n, int cache)
{
    const char *path = g_file;
    pqc_pq out, again;
    unsigned char sentinel[sizeof out];
    pqc_result r;
    FILE *fp;
    memset(&out, 0xa5, sizeof out);
    memcpy(sentinel, &out, sizeof out);
    switch (mode) {
    case 0: case 5: case 1: case 6:
        if (!(fp = fopen(g_file, "wb")) || (n && fwrite(body, 1, n, fp) != n)) fz_fail("cannot write the input file", PQC_SUCCESS);
        if (mode == 1 || mode == 6) {
            uint64_t h = cache ? cache_file_checksum(body, n) : fz_fnv(body, n);
            unsigned char b[8];
            int i;
            for (i = 0; i < 8; i++) b[i] = (unsigned char)(h >> (8 * i));
            if (fwrite(b, 1, 8, fp) != 8) fz_fail("cannot write the input file", PQC_SUCCESS);
        }
        if (fclose(fp) != 0) fz_fail("cannot write the input file", PQC_SUCCESS);
        break;
    case 2: path = g_dir; break;
    case 3: path = g_fifo; break;
    case 4: path = g_missing; break;
    default: path = ""; break;
    }
    if (cache) {
        fz_cache_file(path);
        return;
    }
    fz_arm();
    r = fz_expect(pqc_pq_load(NULL, path, &out), "pqc_pq_load");
    if (r != PQC_SUCCESS) {
        if (memcmp(&out, sentinel, sizeof out)) fz_fail("a failed pqc_pq_load wrote its output", r);
        return;
    }
    if (mode >= 2 && mode <= 4) fz_fail("pqc_pq_load of no regular file succeeded", r);
    if (out.dim != out.m * out.dsub || out.bits < 1 || out.bits > 8 || out.ksub != 1 << out.bits || !out.centroids)
        fz_fail("pqc_pq_load gave an inconsistent quantizer", r);
    if (fz_expect(pqc_pq_save(&out, g_saved), "pqc_pq_save") != PQC_SUCCESS ||
        fz_expect(pqc_pq_load(NULL, g_saved, &again), "pqc_pq_load of a saved quantizer") != PQC_SUCCESS)
        fz_fail("a loaded quantizer does not save and load back", r);
    if (again.dim != out.dim || again.m != out.m || again.bits != out.bits || again.half_bands != out.half_bands ||
        memcmp(again.centroids, out.centroids, sizeof(float) * (size_t)out.dim * (size_t)out.ksub) ||
        (again.metric == NULL) != (out.metric == NULL) ||
        (out.metric && memcmp(again.metric, out.metric, sizeof(float) * (size_t)out.dim)))
        fz_fail("a quantizer saved and loaded back differs", r);
    pqc_pq_free(&again);
    pqc_pq_free(&out);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    unsigned mode = size > 0 ? data[0] & 7u : 0, how = size > 1 ? data[1] : 0;
    const unsigned char *body = size > 2 ? data + 2 : data;
    size_t n = size > 2 ? size - 2 : 0;
    const char *path = g_file;
    pqc_scheduler *s, *t;
    pqc_scheduler_fit before, after, again;
    pqc_result r;
    double t0;

    fz_setup();
    if (how >= 128) {
        fz_file(mode, body, n, how >= 192);
        return 0;
    }
    s = fz_scheduler(how);
    before = pqc_scheduler_get_fit(s);
    switch (mode) {
    case 0: case 5: if (!fz_write(g_file, body, n, 0)) fz_fail("cannot write the input file", PQC_SUCCESS); break;
    case 1: case 6: if (!fz_write(g_file, body, n, 1)) fz_fail("cannot write the input file", PQC_SUCCESS); break;
    case 2: path = g_dir; break;
    case 3: path = g_fifo; break;
    case 4: path = g_missing; break;
    default: path = ""; break;
    }
    fz_arm();
    t0 = fz_now();
    r = fz_expect(pqc_scheduler_load(s, path), "pqc_scheduler_load");
    /* a load reads at most a small file: it must not wait (libFuzzer's timer interrupts
       a blocked open every few seconds, so a wait shows as time, not as a hang) */
    if (fz_now() - t0 > 2.0) fz_fail("pqc_scheduler_load blocked for more than 2 s", r);
    after = pqc_scheduler_get_fit(s);
    if (mode == 7) {
        if (r == PQC_SUCCESS) fz_fail("pqc_scheduler_load of an empty path succeeded", r);
        fz_arm();
        if (fz_expect(pqc_scheduler_load(s, NULL), "pqc_scheduler_load(NULL path)") == PQC_SUCCESS)
            fz_fail("pqc_scheduler_load with a null path succeeded", PQC_SUCCESS);
        fz_arm();
        if (fz_expect(pqc_scheduler_load(NULL, g_file), "pqc_scheduler_load(NULL scheduler)") == PQC_SUCCESS)
            fz_fail("pqc_scheduler_load with a null scheduler succeeded", PQC_SUCCESS);
    }
    if (r != PQC_SUCCESS) {
        if (!fz_same_fit(&before, &after)) fz_fail("a failed load changed the scheduler's fit", r);
        if ((mode == 2 || mode == 3 || mode == 4) && r != PQC_ERROR_IO && r != PQC_ERROR_BAD_FILE)
            fz_fail("a path without a readable file failed with neither PQC_ERROR_IO nor PQC_ERROR_BAD_FILE", r);
        pqc_scheduler_destroy(s);
        return 0;
    }
    if (mode == 2 || mode == 3 || mode == 4) fz_fail("a load from a path without a regular file succeeded", r);
    if (!fz_finite_fit(&after)) fz_fail("a successful load yields non-finite coefficients", r);
    if (!(after.b1 > 0) || after.n1 < 1 || after.n2 < 1) fz_fail("a successful load yields an unusable fit", r);
    /* round trip: save, load into a fresh scheduler, same fit */
    fz_arm();
    r = fz_expect(pqc_scheduler_save(s, g_saved), "pqc_scheduler_save");
    if (r != PQC_SUCCESS) fz_fail("saving a loaded fit failed", r);
    t = fz_scheduler(0);
    fz_arm();
    r = fz_expect(pqc_scheduler_load(t, g_saved), "pqc_scheduler_load(saved)");
    if (r != PQC_SUCCESS) fz_fail("a file written by pqc_scheduler_save does not load", r);
    again = pqc_scheduler_get_fit(t);
    if (!fz_same_fit(&after, &again)) fz_fail("save then load changed the fit", r);
    /* the iteration count from a loaded fit stays in the scheduler's range (3..300) */
    {
        int it = pqc_scheduler_iters(t, 32768.0, 8);
        if (it < 3 || it > 300) fz_fail("pqc_scheduler_iters left [t_min, t_max] after a load", PQC_SUCCESS);
    }
    pqc_scheduler_destroy(t);
    pqc_scheduler_destroy(s);
    return 0;
}
