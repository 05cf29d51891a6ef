/* test_util.h - what the test programs share: files (whole-file read and write, paths
   in the temporary directory), random rows, allocator callbacks (plain, and one that
   fails at its n-th call) and, when pqcache.h was included before this header, the
   runtimes and descriptions the tests start from.

   Header-only; every function is static and may go unused (no warning under gcc or
   clang, as C99 or C++). */
#ifndef PQC_TESTS_TEST_UTIL_H
#define PQC_TESTS_TEST_UTIL_H

#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "synth.h"

#if defined(__GNUC__) || defined(__clang__)
#define TU_FN static __attribute__((unused))
#define TU_PRINTF(f, a) __attribute__((format(printf, f, a)))
#else
#define TU_FN static
#define TU_PRINTF(f, a)
#endif

/* TU_TSAN: 1 in a ThreadSanitizer build (10-20x slower), where a test may leave out the
   configurations that start no thread: races are what it is there for, and the other
   builds run those */
#if defined(__SANITIZE_THREAD__)
#define TU_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define TU_TSAN 1
#endif
#endif
#ifndef TU_TSAN
#define TU_TSAN 0
#endif

/* ----- files ------------------------------------------------------------------------- */

/* The whole file at path in a buffer with a NUL byte after it (NULL on failure); *size
   is its length. */
TU_FN unsigned char *tu_file_image(const char *path, long *size)
{
    FILE *f = fopen(path, "rb");
    unsigned char *img = NULL;
    if (!f) return NULL;
    if (fseek(f, 0, SEEK_END) == 0 && (*size = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0 &&
        (img = (unsigned char *)malloc((size_t)*size + 1)) != NULL) {
        if (fread(img, 1, (size_t)*size, f) == (size_t)*size) {
            img[*size] = 0;
        } else {
            free(img);
            img = NULL;
        }
    }
    fclose(f);
    return img;
}

/* Writes n bytes of p to path; 1 on success. */
TU_FN int tu_file_write(const char *path, const void *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    int ok = f && (n == 0 || fwrite(p, 1, n, f) == n);
    if (f && fclose(f) != 0) ok = 0;
    return ok;
}

/* The directory for temporary files: $TMPDIR, or /tmp without it. */
TU_FN const char *tu_tmp_dir(void)
{
    const char *dir = getenv("TMPDIR");
    return dir && dir[0] ? dir : "/tmp";
}

TU_FN void tu_tmp_path(char *out, size_t n, const char *fmt, ...) TU_PRINTF(3, 4);

/* "DIR/pqc_PID_NAME" in out, DIR tu_tmp_dir(), NAME printf-formatted from fmt:
   a name of this process's own, so that the programs and their builds (plain, under
   the sanitizers) can run side by side. */
TU_FN void tu_tmp_path(char *out, size_t n, const char *fmt, ...)
{
    va_list ap;
    int k = snprintf(out, n, "%s/pqc_%ld_", tu_tmp_dir(), (long)getpid());
    if (k < 0 || (size_t)k >= n) return;
    va_start(ap, fmt);
    vsnprintf(out + k, n - (size_t)k, fmt, ap);
    va_end(ap);
}

/* ----- random rows ------------------------------------------------------------------- */

/* A standard normal value from the stream *rng (synth.h's generator). */
TU_FN float tu_normal(uint64_t *rng) { return synth__normal(rng); }

/* A value uniform in [-1, 1) from the stream *rng. */
TU_FN float tu_uniform(uint64_t *rng)
{
    return (float)((double)(synth__next(rng) >> 11) / 9007199254740992.0) * 2.0f - 1.0f;
}

/* n x cols values of gen(rng), row after row (malloc'd, one spare byte: not NULL when
   n * cols is 0; NULL only when out of memory). */
TU_FN float *tu_rows_of(float (*gen)(uint64_t *), uint64_t *rng, size_t n, size_t cols)
{
    float *x = (float *)malloc(n * cols * sizeof(float) + 1);
    size_t i;
    if (x)
        for (i = 0; i < n * cols; i++) x[i] = gen(rng);
    return x;
}
TU_FN float *tu_normal_rows(uint64_t *rng, size_t n, size_t cols) { return tu_rows_of(tu_normal, rng, n, cols); }
TU_FN float *tu_uniform_rows(uint64_t *rng, size_t n, size_t cols) { return tu_rows_of(tu_uniform, rng, n, cols); }

/* 1 when a[0..n) is strictly ascending (a selection: sorted, no index twice) */
TU_FN int tu_ascending_unique(const uint32_t *a, size_t n)
{
    size_t i;
    for (i = 1; i < n; i++)
        if (a[i] <= a[i - 1]) return 0;
    return 1;
}

/* whether x is among the n indices of a */
TU_FN int tu_contains(const uint32_t *a, size_t n, uint32_t x)
{
    size_t i;
    for (i = 0; i < n; i++)
        if (a[i] == x) return 1;
    return 0;
}

/* ----- allocator callbacks ----------------------------------------------------------- */

/* malloc and free with the callbacks' signature (pqc_allocator and the like) */
TU_FN void *tu_malloc(size_t n, void *user)
{
    (void)user;
    return malloc(n);
}
TU_FN void tu_free(void *p, void *user)
{
    (void)user;
    free(p);
}

/* An allocator that fails once, at its call number fail_at (from 0; -1: never), and
   counts its calls and the blocks still held (thread-safe): tu_fail_alloc and
   tu_fail_free with user = the tu_failing. */
typedef struct tu_failing {
    pthread_mutex_t mu;
    long calls, fail_at, live;
    int fired; /* the failure happened */
} tu_failing;

TU_FN void *tu_fail_alloc(size_t n, void *user)
{
    tu_failing *f = (tu_failing *)user;
    void *p = NULL;
    pthread_mutex_lock(&f->mu);
    if (f->calls++ == f->fail_at) f->fired = 1;
    else if ((p = malloc(n)) != NULL) f->live++;
    pthread_mutex_unlock(&f->mu);
    return p;
}
TU_FN void tu_fail_free(void *p, void *user)
{
    tu_failing *f = (tu_failing *)user;
    if (!p) return;
    pthread_mutex_lock(&f->mu);
    f->live--;
    pthread_mutex_unlock(&f->mu);
    free(p);
}

/* ----- runtimes and descriptions (pqcache.h included first) -------------------------- */

#ifdef PQCACHE_H

/* A runtime for d, or NULL with the reason on stderr. */
TU_FN pqc_runtime *tu_runtime(const pqc_runtime_desc *d)
{
    pqc_runtime *rt = NULL;
    if (pqc_runtime_create(d, &rt) != PQC_SUCCESS) {
        fprintf(stderr, "%s runtime: %s\n", d->backend == PQC_BACKEND_CUDA ? "CUDA" : "CPU", pqc_last_error());
        return NULL;
    }
    return rt;
}

/* A CPU runtime of `threads` workers (0: 1, -1: none, jobs inline) on the SIMD level
   simd (PQC_SIMD_AUTO: the best the processor has). */
TU_FN pqc_runtime *tu_cpu_runtime_simd(int threads, pqc_simd simd)
{
    pqc_runtime_desc d;
    memset(&d, 0, sizeof d);
    d.n_threads = threads;
    d.simd = simd;
    return tu_runtime(&d);
}
TU_FN pqc_runtime *tu_cpu_runtime(int threads) { return tu_cpu_runtime_simd(threads, PQC_SIMD_AUTO); }

/* A CUDA runtime on device 0 (a GPU, or the CPU stand-in driver PQC_CUDA_DRIVER_PATH
   names) of `threads` workers, its kernels cached in build/kernel-cache, or in the
   directory PQC_TEST_KERNEL_CACHE names (tests/cuda_emu/run.sh: the one its other
   programs use, so that NVRTC compiles the kernels once there). */
TU_FN pqc_runtime_desc tu_cuda_runtime_desc(int threads)
{
    pqc_runtime_desc d;
    const char *dir = getenv("PQC_TEST_KERNEL_CACHE");
    memset(&d, 0, sizeof d);
    d.n_threads = threads;
    d.backend = PQC_BACKEND_CUDA;
    d.cuda_kernel_cache = dir && dir[0] ? dir : "build/kernel-cache";
    return d;
}
TU_FN pqc_runtime *tu_cuda_runtime(int threads)
{
    pqc_runtime_desc d = tu_cuda_runtime_desc(threads);
    return tu_runtime(&d);
}

/* An inline runtime (no workers: every allocation counted is the calling test's call's),
   on the CPU or (cuda) as tu_cuda_runtime's, whose allocator counts its calls and blocks
   into *fa (set up here; never failing). tu_failing_live ends the count. */
TU_FN pqc_runtime *tu_counting_runtime(tu_failing *fa, int cuda)
{
    pqc_runtime_desc d = tu_cuda_runtime_desc(-1);
    if (!cuda) {
        memset(&d, 0, sizeof d);
        d.n_threads = -1;
    }
    memset(fa, 0, sizeof *fa);
    pthread_mutex_init(&fa->mu, NULL);
    fa->fail_at = -1;
    d.allocator.alloc = tu_fail_alloc;
    d.allocator.free = tu_fail_free;
    d.allocator.user = fa;
    return tu_runtime(&d);
}
/* The blocks *fa still counts (0: every one freed); its mutex is destroyed. */
TU_FN long tu_failing_live(tu_failing *fa)
{
    pthread_mutex_destroy(&fa->mu);
    return fa->live;
}

/* A product quantizer: m subspaces of `bits` bits, `iters` k-means iterations, seed. */
TU_FN pqc_pq_desc tu_pq_desc(int m, int bits, int iters, uint64_t seed)
{
    pqc_pq_desc d;
    memset(&d, 0, sizeof d);
    d.m = m;
    d.bits = bits;
    d.iters = iters;
    d.seed = seed;
    return d;
}

/* The base cache: `layers` layers of hkv KV heads and hq query heads of d dimensions,
   up to 65,536 tokens, PQ with m = 2, 6 bits, 4 iterations, seed 1, 32 sinks and the PQ
   top-k alone (no re-ranking: a test that re-ranks says so); every other field 0 (its
   default). Tests of the defaults themselves start from a zeroed desc. */
TU_FN pqc_cache_desc tu_cache_desc(int layers, int hkv, int hq, int d)
{
    pqc_cache_desc cd;
    memset(&cd, 0, sizeof cd);
    cd.n_layers = layers;
    cd.n_kv_heads = hkv;
    cd.n_q_heads = hq;
    cd.head_dim = d;
    cd.max_tokens = 1 << 16;
    cd.pq.m = 2;
    cd.pq.bits = 6;
    cd.pq.iters = 4;
    cd.pq.seed = 1;
    cd.n_sink = 32;
    cd.rerank = -1;
    return cd;
}

/* A gather buffer of `rows` rows per KV head for K and V (the returned memory, freed by
   the caller; NULL when it cannot be had) */
TU_FN float *tu_kv_out(pqc_kv_out *o, int hkv, size_t rows, int d)
{
    float *b = (float *)malloc(sizeof(float) * 2 * (size_t)hkv * rows * (size_t)d);
    o->k = b;
    o->v = b ? b + (size_t)hkv * rows * (size_t)d : NULL;
    o->head_stride = rows;
    return b;
}

/* Decode steps on n caches of `layers` layers: at step s, on every layer and cache in
   turn, the row k/v + s * kvcols is appended, then (how) 0: select + fetch into out,
   1: select + fetch_device, 2: the device step, with query q + s * qcols. In the last
   `counted` of the steps, the calls *fa counts go to appends[i] (in the appends) and
   steps[i] (the rest) of cache i (caches of at most 64 KV heads). Returns the first
   failure, PQC_SUCCESS otherwise. */
TU_FN pqc_result tu_counted_steps(pqc_cache *const *c, pqc_selection *sel, int n, int layers, const float *k,
                                  const float *v, size_t kvcols, const float *q, size_t qcols, int nsteps, int counted,
                                  int how, pqc_kv_out *out, tu_failing *fa, long *appends, long *steps)
{
    pqc_kv_device dk;
    size_t cnt[64];
    pqc_result r = PQC_SUCCESS;
    int s, l, i;
    for (i = 0; i < n; i++) appends[i] = steps[i] = 0;
    for (s = 0; s < nsteps && r == PQC_SUCCESS; s++)
        for (l = 0; l < layers && r == PQC_SUCCESS; l++)
            for (i = 0; i < n && r == PQC_SUCCESS; i++) {
                const float *qs = q + (size_t)s * qcols;
                long before = fa->calls, mid;
                r = pqc_cache_append(c[i], l, k + (size_t)s * kvcols, v + (size_t)s * kvcols);
                mid = fa->calls;
                if (r != PQC_SUCCESS) break;
                if (how == 2) {
                    r = pqc_cache_step_device(c[i], l, qs, &dk, cnt);
                } else if ((r = pqc_cache_select(c[i], l, qs, &sel[i])) == PQC_SUCCESS) {
                    r = how == 1 ? pqc_cache_fetch_device(c[i], l, &sel[i], &dk) : pqc_cache_fetch(c[i], l, &sel[i], out);
                }
                if (s >= nsteps - counted) {
                    appends[i] += mid - before;
                    steps[i] += fa->calls - mid;
                }
            }
    return r;
}

#endif /* PQCACHE_H */

#endif
