/* test_nvrtc.c - tests of the CUDA run-time loader (pqcache.h) and of the
 * embedded kernel source (embedded in pqcache.h), runnable on machines without a GPU.
 *
 *   - the embedded string equals pqcache_kernels.cu byte for byte (stale check)
 *   - NVRTC, loaded with dlopen through the loader, compiles the kernels for sm_80 and
 *     sm_90 (cubin) and compute_80 / compute_90 (PTX) with a log free of warnings, and
 *     every kernel the backend uses is in the output
 *   - without a driver, loading fails with "no CUDA driver (libcuda.so.1 not found)"
 *   - a library that lacks a symbol makes the load fail cleanly, naming the symbol
 *   - the toolkit's stub libcuda is recognised as "no CUDA driver"
 *   - architecture choice, FNV-1a hash and the compiled-image disk cache
 *
 * Build: make test-nvrtc (cc ... -ldl; NVRTC is not linked). Usage:
 *   build/test_nvrtc [-v]
 * Environment: PQC_NVRTC_PATH (full path of libnvrtc), PQC_SOURCE_ROOT (directory of
 * pqcache_kernels.cu when not run from the repository root).
 * Last line of output: "N passed, N failed" (", N skipped" when some were skipped);
 * exit status 1 when any test failed.
 */
#define _POSIX_C_SOURCE 200809L
#include <dlfcn.h>
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include <stdio.h>
#include <stdlib.h>
#include <errno.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#define PQCACHE_IMPLEMENTATION
#include "../pqcache.h"

/* ------------------------------------------------------------------------------------ */
/* A tiny harness                                                                       */
/* ------------------------------------------------------------------------------------ */

enum { T_PASS, T_FAIL, T_SKIP };
static int g_verbose;
static int g_passed, g_failed, g_skipped;
static char g_reason[1024];
static volatile size_t g_small = 10; /* a size the compiler cannot see */

#define T_CHECK(cond, ...)                                                   \
    do {                                                                     \
        if (!(cond)) {                                                       \
            snprintf(g_reason, sizeof(g_reason), __VA_ARGS__);               \
            fprintf(stderr, "  %s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
            return T_FAIL;                                                   \
        }                                                                    \
    } while (0)

#define T_SKIP_IF(cond, ...)                                                 \
    do {                                                                     \
        if (cond) {                                                          \
            snprintf(g_reason, sizeof(g_reason), __VA_ARGS__);               \
            return T_SKIP;                                                   \
        }                                                                    \
    } while (0)

static void run_test(const char *name, int (*fn)(void))
{
    int r;
    g_reason[0] = '\0';
    r = fn();
    if (r == T_PASS) {
        ++g_passed;
        if (g_verbose) printf("ok   %s\n", name);
    } else if (r == T_SKIP) {
        ++g_skipped;
        printf("SKIP %s: %s\n", name, g_reason);
    } else {
        ++g_failed;
        printf("FAIL %s: %s\n", name, g_reason);
    }
}

/* ------------------------------------------------------------------------------------ */
/* Host services for the loader                                                         */
/* ------------------------------------------------------------------------------------ */

static void *host_alloc(size_t n, void *user) { (void)user; return malloc(n); }
static void host_free(void *p, void *user) { (void)user; free(p); }
static const char *host_getenv(const char *name, void *user) { (void)user; return getenv(name); }
static int host_mkdir(const char *path, void *user)
{
    (void)user;
    return mkdir(path, 0755) == 0 || errno == EEXIST ? 0 : -1;
}

static void api_init(pqc__cuApi *api)
{
    pqc__cuHost h;
    h.alloc = host_alloc;
    h.free = host_free;
    h.get_env = host_getenv;
    h.make_dir = host_mkdir;
    h.user = NULL;
    pqc__cu_api_init(api, &h);
}

/* Kernels the backend calls; each must be in the compiled module. */
static const char *const k_kernels[] = {
    "pqc_lut_build", "pqc_scan_stats", "pqc_softmax_finalize", "pqc_scan",
    "pqc_topk_pass", "pqc_topk_count", "pqc_topk_compact", "pqc_gather_kv",
    "pqc_cache_fill", "pqc_centroid_norms", "pqc_assign_codes", "pqc_kmeans_assign",
    "pqc_kmeans_update", "pqc_kmeans_assign_dots", "pqc_select_admit", "pqc_lut_sum"
};
#define N_KERNELS ((int)(sizeof(k_kernels) / sizeof(k_kernels[0])))

/* Reads a whole file (NUL-terminated); NULL when absent. */
static char *read_file(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    char *buf;
    long len;
    if (!f) return NULL;
    if (fseek(f, 0, SEEK_END) != 0 || (len = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) != 0) {
        fclose(f);
        return NULL;
    }
    buf = (char *)malloc((size_t)len + 1);
    if (buf && fread(buf, 1, (size_t)len, f) != (size_t)len) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf) {
        buf[len] = '\0';
        *n = (size_t)len;
    }
    return buf;
}

/* pqcache_kernels.cu: $PQC_SOURCE_ROOT, the directory above this file, ., .. */
static char *read_kernel_source(size_t *n, char *path, size_t path_size)
{
    char dir[512];
    const char *env = getenv("PQC_SOURCE_ROOT");
    const char *slash;
    const char *cands[4];
    int i;
    cands[0] = env;
    snprintf(dir, sizeof(dir), "%s", __FILE__);
    slash = strrchr(dir, '/');
    if (slash) {
        dir[slash - dir] = '\0';
        strcat(dir, "/..");
        cands[1] = dir;
    } else {
        cands[1] = "..";
    }
    cands[2] = ".";
    cands[3] = "..";
    for (i = 0; i < 4; ++i) {
        char *s;
        if (!cands[i]) continue;
        snprintf(path, path_size, "%s/pqcache_kernels.cu", cands[i]);
        s = read_file(path, n);
        if (s) return s;
    }
    return NULL;
}

static int contains_ci(const char *hay, const char *needle)
{
    size_t n = strlen(needle), i, j;
    for (i = 0; hay[i]; ++i) {
        for (j = 0; j < n; ++j) {
            char a = hay[i + j], b = needle[j];
            if (a >= 'A' && a <= 'Z') a = (char)(a - 'A' + 'a');
            if (!a || a != b) break;
        }
        if (j == n) return 1;
    }
    return 0;
}

/* Finds "\0name\0" in a binary image (the ELF string table of a cubin). */
static int image_has_symbol(const void *img, size_t n, const char *name)
{
    const char *p = (const char *)img;
    size_t len = strlen(name), i;
    for (i = 1; i + len < n; ++i)
        if (p[i - 1] == '\0' && p[i + len] == '\0' && memcmp(p + i, name, len) == 0) return 1;
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* NVRTC, loaded once                                                                   */
/* ------------------------------------------------------------------------------------ */

static pqc__cuApi g_nv;
static int g_nv_status = -1;

static int nvrtc_ready(void)
{
    if (g_nv_status < 0) {
        api_init(&g_nv);
        g_nv_status = pqc__cu_load_nvrtc(&g_nv);
        if (g_verbose && g_nv_status == PQC__CU_OK)
            printf("     NVRTC %d.%d from %s\n", g_nv.nvrtc_major, g_nv.nvrtc_minor,
                   g_nv.nvrtc_path);
    }
    return g_nv_status == PQC__CU_OK;
}

/* ------------------------------------------------------------------------------------ */
/* Tests                                                                                */
/* ------------------------------------------------------------------------------------ */

/* (d) the embedded copy is byte-identical to the source file */
static int test_embedded_source_is_current(void)
{
    char path[600];
    size_t n = 0, i;
    char *src = read_kernel_source(&n, path, sizeof(path));
    T_CHECK(src != NULL, "pqcache_kernels.cu not found (set PQC_SOURCE_ROOT)");
    if (n != sizeof(pqc__kernel_source) - 1 || memcmp(src, pqc__kernel_source, n) != 0) {
        for (i = 0; i < n && i < sizeof(pqc__kernel_source) - 1; ++i)
            if (src[i] != pqc__kernel_source[i]) break;
        free(src);
        T_CHECK(0, "the kernels embedded in pqcache.h are stale (%s: %lu bytes, embedded: %lu, first "
                   "difference at byte %lu); run tools/embed_kernels.sh",
                path, (unsigned long)n, (unsigned long)(sizeof(pqc__kernel_source) - 1),
                (unsigned long)i);
    }
    free(src);
    T_CHECK(pqc__kernel_source[sizeof(pqc__kernel_source) - 1] == '\0', "not NUL-terminated");
    T_CHECK(strlen(pqc__kernel_source) == sizeof(pqc__kernel_source) - 1,
            "embedded source contains a NUL byte");
    return T_PASS;
}

/* (a) compile for one target and check log and kernel names */
static int compile_and_check(int arch, int cubin)
{
    void *img = NULL;
    size_t size = 0;
    char log[8192];
    int st, i;
    T_SKIP_IF(!nvrtc_ready(), "%s", g_nv.msg);
    st = pqc__cu_compile(&g_nv, pqc__kernel_source, "pqcache_kernels.cu", arch, cubin, &img,
                         &size, log, sizeof(log));
    T_CHECK(st == PQC__CU_OK, "%s_%d: %.400s\n%.500s", cubin ? "sm" : "compute", arch, g_nv.msg, log);
    if (log[0] && (contains_ci(log, "warning") || contains_ci(log, "error"))) {
        pqc__cu_free(&g_nv, img);
        T_CHECK(0, "%s_%d: compiler log is not clean:\n%.900s", cubin ? "sm" : "compute", arch, log);
    }
    T_CHECK(img != NULL && size > 64, "empty output");
    if (cubin) {
        if (memcmp(img, "\177ELF", 4) != 0) {
            pqc__cu_free(&g_nv, img);
            T_CHECK(0, "sm_%d output is not an ELF cubin", arch);
        }
        for (i = 0; i < N_KERNELS; ++i) {
            if (!image_has_symbol(img, size, k_kernels[i])) {
                pqc__cu_free(&g_nv, img);
                T_CHECK(0, "sm_%d cubin lacks kernel %s", arch, k_kernels[i]);
            }
        }
    } else {
        const char *ptx = (const char *)img;
        char target[32];
        T_CHECK(ptx[size - 1] == '\0', "PTX is not NUL-terminated");
        snprintf(target, sizeof(target), ".target sm_%d", arch);
        if (!strstr(ptx, target)) {
            pqc__cu_free(&g_nv, img);
            T_CHECK(0, "PTX lacks \"%s\"", target);
        }
        for (i = 0; i < N_KERNELS; ++i) {
            char entry[96];
            snprintf(entry, sizeof(entry), ".entry %s(", k_kernels[i]);
            if (!strstr(ptx, entry)) {
                pqc__cu_free(&g_nv, img);
                T_CHECK(0, "compute_%d PTX lacks \"%s\"", arch, entry);
            }
        }
    }
    pqc__cu_free(&g_nv, img);
    return T_PASS;
}

static int test_compile_sm80_cubin(void) { return compile_and_check(80, 1); }
static int test_compile_sm90_cubin(void) { return compile_and_check(90, 1); }
static int test_compile_compute80_ptx(void) { return compile_and_check(80, 0); }
static int test_compile_compute90_ptx(void) { return compile_and_check(90, 0); }

/* a broken source gives PQC__CU_ERR_COMPILE and a log naming the error */
static int test_compile_error_reports_log(void)
{
    static const char bad[] = "extern \"C\" __global__ void k(int *p) { p[0] = undefined_name; }\n";
    void *img = NULL;
    size_t size = 0;
    char log[4096];
    int st;
    T_SKIP_IF(!nvrtc_ready(), "%s", g_nv.msg);
    st = pqc__cu_compile(&g_nv, bad, "bad.cu", 80, 1, &img, &size, log, sizeof(log));
    T_CHECK(st == PQC__CU_ERR_COMPILE, "status %d (%s)", st, g_nv.msg);
    T_CHECK(img == NULL && size == 0, "output set on failure");
    T_CHECK(strstr(log, "undefined_name") != NULL, "log does not name the error: %.900s", log);
    T_CHECK(strstr(g_nv.msg, "sm_80") != NULL, "message: %s", g_nv.msg);
    /* a log buffer of one byte is left empty, not overrun */
    st = pqc__cu_compile(&g_nv, bad, "bad.cu", 80, 1, &img, &size, log, 1);
    T_CHECK(st == PQC__CU_ERR_COMPILE && log[0] == '\0', "one-byte log");
    return T_PASS;
}

/* architecture choice against the NVRTC in use */
static int test_pick_arch(void)
{
    int arch = 0, cubin = -1, st, n = 0, archs[128], newest;
    T_SKIP_IF(!nvrtc_ready(), "%s", g_nv.msg);
    T_SKIP_IF(!g_nv.nvrtcGetSupportedArchs, "NVRTC %d.%d lists no architectures",
              g_nv.nvrtc_major, g_nv.nvrtc_minor);
    T_CHECK(g_nv.nvrtcGetNumSupportedArchs(&n) == 0 && n > 0 && n <= 128, "arch count %d", n);
    T_CHECK(g_nv.nvrtcGetSupportedArchs(archs) == 0, "arch list");
    newest = archs[n - 1];
    st = pqc__cu_pick_arch(&g_nv, 90, &arch, &cubin);
    T_CHECK(st == PQC__CU_OK && arch == 90 && cubin == 1, "sm_90: st %d arch %d cubin %d", st,
            arch, cubin);
    /* a GPU newer than this NVRTC knows: PTX for the newest architecture it has */
    st = pqc__cu_pick_arch(&g_nv, newest + 7, &arch, &cubin);
    T_CHECK(st == PQC__CU_OK && arch == newest && cubin == 0, "future GPU: st %d arch %d cubin %d",
            st, arch, cubin);
    /* a GPU older than NVRTC supports */
    st = pqc__cu_pick_arch(&g_nv, 30, &arch, &cubin);
    T_CHECK(st == PQC__CU_ERR_ARCH, "sm_30: st %d", st);
    T_CHECK(strstr(g_nv.msg, "sm_30") != NULL, "message: %s", g_nv.msg);
    return T_PASS;
}

/* (b) no driver: clean failure with the expected message */
static int test_no_driver_message(void)
{
    pqc__cuApi api;
    void *probe = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    int st;
    if (probe) dlclose(probe);
    T_SKIP_IF(probe != NULL, "a CUDA driver is installed here: the no-driver message "
                             "cannot be observed");
    api_init(&api);
    st = pqc__cu_load(&api, 1);
    T_CHECK(st == PQC__CU_ERR_NO_DRIVER, "status %d (%s)", st, api.msg);
    T_CHECK(strcmp(api.msg, "no CUDA driver (libcuda.so.1 not found)") == 0, "message: %s",
            api.msg);
    T_CHECK(api.lib_driver == NULL && api.lib_nvrtc == NULL && api.lib_blaslt == NULL,
            "a library stayed loaded");
    T_CHECK(api.cuInit == NULL && api.nvrtcCompileProgram == NULL, "table not cleared");
    /* the table was not touched beyond the message: loading again gives the same answer */
    st = pqc__cu_load(&api, 0);
    T_CHECK(st == PQC__CU_ERR_NO_DRIVER, "second load: status %d", st);
    pqc__cu_unload(&api);
    return T_PASS;
}

/* (c) a library that lacks the symbols: clean failure naming the first missing one */
static int test_missing_symbol_driver(void)
{
    static const char *const names[] = { "libpqc-does-not-exist.so.1", "libm.so.6" };
    pqc__cuApi api;
    int st;
    api_init(&api);
    st = pqc__cu_open_driver(&api, names, 2);
    T_CHECK(st == PQC__CU_ERR_DRIVER_SYMBOL, "status %d (%s)", st, api.msg);
    T_CHECK(strstr(api.msg, "lacks symbol cuInit") != NULL, "message: %s", api.msg);
    T_CHECK(strstr(api.msg, "libm.so.6") != NULL, "message does not name the library: %s",
            api.msg);
    T_CHECK(api.lib_driver == NULL && api.cuInit == NULL && api.cuMemAlloc_v2 == NULL,
            "table not cleared");
    /* none of the names loads */
    st = pqc__cu_open_driver(&api, names, 1);
    T_CHECK(st == PQC__CU_ERR_NO_DRIVER, "status %d", st);
    T_CHECK(strcmp(api.msg, "no CUDA driver (libpqc-does-not-exist.so.1 not found)") == 0,
            "message: %s", api.msg);
    pqc__cu_unload(&api);
    return T_PASS;
}

static int test_missing_symbol_nvrtc_and_blaslt(void)
{
    static const char *const libm[] = { "libm.so.6" };
    pqc__cuApi api;
    int st;
    api_init(&api);
    st = pqc__cu_open_nvrtc(&api, libm, 1);
    T_CHECK(st == PQC__CU_ERR_NVRTC_SYMBOL, "nvrtc status %d (%s)", st, api.msg);
    T_CHECK(strstr(api.msg, "lacks symbol nvrtcVersion") != NULL, "message: %s", api.msg);
    T_CHECK(api.lib_nvrtc == NULL && api.nvrtcVersion == NULL, "nvrtc table not cleared");
    st = pqc__cu_open_blaslt(&api, libm, 1);
    T_CHECK(st == PQC__CU_ERR_CUBLASLT_SYMBOL, "cublasLt status %d (%s)", st, api.msg);
    T_CHECK(strstr(api.msg, "lacks symbol cublasLtCreate") != NULL, "message: %s", api.msg);
    T_CHECK(api.lib_blaslt == NULL && api.cublasLtCreate == NULL, "blaslt table not cleared");
    pqc__cu_unload(&api);
    return T_PASS;
}

/* the real cuBLASLt resolves completely (no device needed to load it) */
static int test_blaslt_resolves(void)
{
    pqc__cuApi api;
    int st;
    api_init(&api);
    st = pqc__cu_load_blaslt(&api);
    T_SKIP_IF(st == PQC__CU_ERR_NO_CUBLASLT, "%s", api.msg);
    T_CHECK(st == PQC__CU_OK, "status %d (%s)", st, api.msg);
    T_CHECK(api.cublasLtMatmul != NULL && api.cublasLtMatmulAlgoGetHeuristic != NULL,
            "functions not resolved");
    T_CHECK(api.blaslt_version >= 110000, "cublasLtGetVersion %lu",
            (unsigned long)api.blaslt_version);
    pqc__cu_unload(&api);
    T_CHECK(api.lib_blaslt == NULL && api.cublasLtMatmul == NULL, "unload left entries");
    return T_PASS;
}

/* the toolkit's stub libcuda has every symbol but cuInit reports CUDA_ERROR_STUB_LIBRARY */
static int test_stub_driver(void)
{
    static const char *const names[] = { "/usr/local/cuda/lib64/stubs/libcuda.so" };
    pqc__cuApi api;
    int st;
    api_init(&api);
    st = pqc__cu_open_driver(&api, names, 1);
    T_SKIP_IF(st == PQC__CU_ERR_NO_DRIVER, "no stub library at %s", names[0]);
    T_CHECK(st == PQC__CU_OK, "open: status %d (%s)", st, api.msg);
    T_CHECK(api.cuLaunchKernel != NULL && api.cuEventElapsedTime != NULL &&
            api.cuMemHostGetDevicePointer_v2 != NULL, "functions not resolved");
    st = pqc__cu_init_driver(&api);
    T_CHECK(st == PQC__CU_ERR_DRIVER_INIT, "init: status %d (%s)", st, api.msg);
    T_CHECK(strstr(api.msg, "stub library") != NULL, "message: %s", api.msg);
    pqc__cu_unload(&api);
    return T_PASS;
}

static int test_fnv(void)
{
    /* published FNV-1a 64 test vectors */
    T_CHECK(pqc__fnv("", 0, PQC__FNV_OFFSET) == 0xcbf29ce484222325ull, "empty");
    T_CHECK(pqc__fnv("a", 1, PQC__FNV_OFFSET) == 0xaf63dc4c8601ec8cull, "\"a\"");
    T_CHECK(pqc__fnv("foobar", 6, PQC__FNV_OFFSET) == 0x85944171f73967e8ull, "foobar");
    /* chaining equals hashing the concatenation */
    T_CHECK(pqc__fnv("bar", 3, pqc__fnv("foo", 3, PQC__FNV_OFFSET)) ==
                0x85944171f73967e8ull, "chained");
    return T_PASS;
}

static int test_cache_key_and_path(void)
{
    pqc__cuApi api;
    char path[600];
    uint64_t k1, k2, k3, k4;
    api_init(&api);
    api.nvrtc_major = 13;
    api.nvrtc_minor = 0;
    k1 = pqc__cu_cache_key(&api, "source A", 90, 1);
    k2 = pqc__cu_cache_key(&api, "source B", 90, 1);
    k3 = pqc__cu_cache_key(&api, "source A", 80, 1);
    k4 = pqc__cu_cache_key(&api, "source A", 90, 0);
    T_CHECK(k1 != k2 && k1 != k3 && k1 != k4, "keys collide");
    T_CHECK(k1 == pqc__cu_cache_key(&api, "source A", 90, 1), "key not stable");
    api.nvrtc_minor = 1;
    T_CHECK(k1 != pqc__cu_cache_key(&api, "source A", 90, 1), "NVRTC version not in key");
    api.nvrtc_minor = 0;
    T_CHECK(pqc__cu_cache_path(&api, "/c", 0x0123456789abcdefull, 90, 1, path, sizeof(path)) == 0,
            "path");
    T_CHECK(strcmp(path, "/c/pqc-0123456789abcdef-sm90-nvrtc13.0.cubin") == 0, "path %s", path);
    T_CHECK(pqc__cu_cache_path(&api, "/c", 1, 86, 0, path, sizeof(path)) == 0 &&
                strcmp(path, "/c/pqc-0000000000000001-compute86-nvrtc13.0.ptx") == 0,
            "path %s", path);
    T_CHECK(pqc__cu_cache_path(&api, "/c", 1, 86, 0, path, g_small) == -1,
            "overlong path accepted");
    return T_PASS;
}

static int remove_tree_entry(const char *dir, const char *name)
{
    char p[700];
    snprintf(p, sizeof(p), "%s/%s", dir, name);
    return remove(p);
}

static int test_cache_dir_defaults(void)
{
    pqc__cuApi api;
    char base[] = "/tmp/pqc_nvrtc_dirXXXXXX";
    char out[512], want[600], xdg_old[512], home_old[512];
    const char *x, *h;
    int had_xdg, had_home, ok1, ok2, ok3;
    struct stat sb;
    T_CHECK(mkdtemp(base) != NULL, "mkdtemp");
    api_init(&api);
    x = getenv("XDG_CACHE_HOME");
    h = getenv("HOME");
    had_xdg = x != NULL;
    had_home = h != NULL;
    snprintf(xdg_old, sizeof(xdg_old), "%s", x ? x : "");
    snprintf(home_old, sizeof(home_old), "%s", h ? h : "");

    /* explicit directory wins */
    ok1 = pqc__cu_cache_dir(&api, "/some/where", out, sizeof(out)) == 0 &&
          strcmp(out, "/some/where") == 0;
    /* $XDG_CACHE_HOME/pqcache, created */
    snprintf(want, sizeof(want), "%s/xdg", base);
    setenv("XDG_CACHE_HOME", want, 1);
    snprintf(want, sizeof(want), "%s/xdg/pqcache", base);
    ok2 = pqc__cu_cache_dir(&api, NULL, out, sizeof(out)) == 0 && strcmp(out, want) == 0 &&
          stat(want, &sb) == 0 && S_ISDIR(sb.st_mode);
    /* $HOME/.cache/pqcache, created */
    unsetenv("XDG_CACHE_HOME");
    setenv("HOME", base, 1);
    snprintf(want, sizeof(want), "%s/.cache/pqcache", base);
    ok3 = pqc__cu_cache_dir(&api, NULL, out, sizeof(out)) == 0 && strcmp(out, want) == 0 &&
          stat(want, &sb) == 0 && S_ISDIR(sb.st_mode);

    if (had_xdg) setenv("XDG_CACHE_HOME", xdg_old, 1); else unsetenv("XDG_CACHE_HOME");
    if (had_home) setenv("HOME", home_old, 1); else unsetenv("HOME");
    remove_tree_entry(base, ".cache/pqcache");
    remove_tree_entry(base, ".cache");
    remove_tree_entry(base, "xdg/pqcache");
    remove_tree_entry(base, "xdg");
    remove(base);
    T_CHECK(ok1, "explicit directory");
    T_CHECK(ok2, "XDG_CACHE_HOME directory");
    T_CHECK(ok3, "HOME directory");
    return T_PASS;
}

static int test_cache_roundtrip(void)
{
    pqc__cuApi api;
    char dir[] = "/tmp/pqc_nvrtc_cacheXXXXXX";
    char path[600];
    unsigned char img[1000];
    void *got = NULL;
    size_t n = 0;
    int i, hit, hit_other, hit_corrupt, hit_trunc, same;
    FILE *f;
    T_CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    api_init(&api);
    api.nvrtc_major = 13;
    for (i = 0; i < 1000; ++i) img[i] = (unsigned char)(i * 7 + 3);
    T_CHECK(pqc__cu_cache_path(&api, dir, 42, 90, 1, path, sizeof(path)) == 0, "path");
    T_CHECK(pqc__cu_cache_read(&api, path, 42, &got, &n) == 0 && got == NULL, "hit before write");
    T_CHECK(pqc__cu_cache_write(&api, path, 42, img, sizeof(img)) == 0, "write");
    hit = pqc__cu_cache_read(&api, path, 42, &got, &n);
    same = hit && n == sizeof(img) && memcmp(got, img, n) == 0;
    pqc__cu_free(&api, got);
    got = NULL;
    hit_other = pqc__cu_cache_read(&api, path, 43, &got, &n); /* another key */
    /* flip one byte of the image: the checksum rejects it */
    f = fopen(path, "r+b");
    if (f) {
        fseek(f, 32 + 500, SEEK_SET);
        fputc(img[500] ^ 0xff, f);
        fclose(f);
    }
    hit_corrupt = pqc__cu_cache_read(&api, path, 42, &got, &n);
    /* truncate */
    f = fopen(path, "wb");
    if (f) {
        fwrite("PQCKIMG1", 1, 8, f);
        fclose(f);
    }
    hit_trunc = pqc__cu_cache_read(&api, path, 42, &got, &n);
    remove(path);
    remove(dir);
    T_CHECK(hit == 1 && same, "round trip");
    T_CHECK(hit_other == 0, "another key hit");
    T_CHECK(hit_corrupt == 0 && got == NULL, "corrupt file accepted");
    T_CHECK(hit_trunc == 0, "truncated file accepted");
    return T_PASS;
}

/* without an allocator nothing is compiled, and the loader says why */
static int test_compile_needs_allocator(void)
{
    pqc__cuApi api;
    void *img = (void *)&api;
    size_t size = 1;
    int st;
    T_SKIP_IF(!nvrtc_ready(), "%s", g_nv.msg);
    api = g_nv;
    api.host.alloc = NULL;
    st = pqc__cu_compile(&api, pqc__kernel_source, NULL, 80, 1, &img, &size, NULL, 0);
    T_CHECK(st == PQC__CU_ERR_ALLOC && img == NULL && size == 0, "status %d (%s)", st, api.msg);
    return T_PASS;
}

int main(int argc, char **argv)
{
    int i;
    for (i = 1; i < argc; ++i)
        if (strcmp(argv[i], "-v") == 0) g_verbose = 1;

    run_test("embedded_source_is_current", test_embedded_source_is_current);
    run_test("fnv1a64", test_fnv);
    run_test("cache_key_and_path", test_cache_key_and_path);
    run_test("cache_dir_defaults", test_cache_dir_defaults);
    run_test("cache_roundtrip", test_cache_roundtrip);
    run_test("no_driver_message", test_no_driver_message);
    run_test("missing_symbol_driver", test_missing_symbol_driver);
    run_test("missing_symbol_nvrtc_and_blaslt", test_missing_symbol_nvrtc_and_blaslt);
    run_test("stub_driver", test_stub_driver);
    run_test("blaslt_resolves", test_blaslt_resolves);
    run_test("pick_arch", test_pick_arch);
    run_test("compile_needs_allocator", test_compile_needs_allocator);
    run_test("compile_error_reports_log", test_compile_error_reports_log);
    run_test("compile_sm80_cubin", test_compile_sm80_cubin);
    run_test("compile_sm90_cubin", test_compile_sm90_cubin);
    run_test("compile_compute80_ptx", test_compile_compute80_ptx);
    run_test("compile_compute90_ptx", test_compile_compute90_ptx);

    if (g_nv.lib_nvrtc) pqc__cu_unload(&g_nv);
    if (g_skipped)
        printf("%d passed, %d failed, %d skipped\n", g_passed, g_failed, g_skipped);
    else
        printf("%d passed, %d failed\n", g_passed, g_failed);
    return g_failed ? 1 : 0;
}
