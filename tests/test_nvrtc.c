/* test_nvrtc.c - tests of the CUDA run-time loader (pqcache.h) and of the
 * embedded kernel source (embedded in pqcache.h), runnable on machines without a GPU.
 *
 *   - the embedded string equals pqcache_kernels.cu byte for byte (stale check)
 *   - NVRTC, loaded with dlopen through the loader, compiles the kernels for sm_80 and
 *     sm_90 (cubin) and compute_80 / compute_90 (PTX) with a log free of warnings, and
 *     every kernel the backend uses is in the output
 *   - without a driver, loading fails with "no CUDA driver (libcuda.so.1 not found)"
 *   - a library that lacks a symbol makes the load fail cleanly, naming the symbol
 *   - the toolkit's stub libcuda is recognised as a stub (its cuInit says so)
 *   - architecture choice, FNV-1a hash and the compiled-image disk cache
 *
 * Build: make test-nvrtc (cc ... -ldl; NVRTC is not linked). Usage:
 *   build/test_nvrtc [-v] [greatest's other flags: -h lists them]
 * (-v also says which NVRTC was loaded, and why a test was skipped).
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
#include "greatest.h"
#include "test_util.h"

/* greatest's assertion, failure and skip with a printf-style message: the message goes
   to g_why, which outlives the test (greatest prints it after the test returns) */
static char g_why[1024];
#define FAILf(...)                                                            \
    do {                                                                      \
        snprintf(g_why, sizeof g_why, __VA_ARGS__);                           \
        FAILm(g_why);                                                         \
    } while (0)
#define ASSERTf(COND, ...)                                                    \
    do {                                                                      \
        greatest_info.assertions++;                                           \
        if (!(COND)) FAILf(__VA_ARGS__);                                      \
    } while (0)
#define SKIPf(...)                                                            \
    do {                                                                      \
        snprintf(g_why, sizeof g_why, __VA_ARGS__);                           \
        SKIPm(g_why);                                                         \
    } while (0)

static volatile size_t g_small = 10; /* a size the compiler cannot see */

/* ------------------------------------------------------------------------------------ */
/* Host services for the loader                                                         */
/* ------------------------------------------------------------------------------------ */

static const char *host_getenv(const char *name, void *user) { (void)user; return getenv(name); }
static int host_mkdir(const char *path, void *user)
{
    (void)user;
    return mkdir(path, 0755) == 0 || errno == EEXIST ? 0 : -1;
}

static void api_init(pqc__cuApi *api)
{
    pqc__cuHost h;
    h.alloc = tu_malloc;
    h.free = tu_free;
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

/* pqcache_kernels.cu (NUL-terminated; NULL when absent): $PQC_SOURCE_ROOT, the directory
   above this file, ., .. */
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
        long len;
        char *s;
        if (!cands[i]) continue;
        snprintf(path, path_size, "%s/pqcache_kernels.cu", cands[i]);
        s = (char *)tu_file_image(path, &len);
        if (s) {
            *n = (size_t)len;
            return s;
        }
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
        if (GREATEST_IS_VERBOSE() && g_nv_status == PQC__CU_OK)
            printf("     NVRTC %d.%d from %s\n", g_nv.nvrtc_major, g_nv.nvrtc_minor,
                   g_nv.nvrtc_path);
    }
    return g_nv_status == PQC__CU_OK;
}

/* ------------------------------------------------------------------------------------ */
/* Tests                                                                                */
/* ------------------------------------------------------------------------------------ */

/* the embedded copy is byte-identical to the source file */
TEST embedded_kernel_source_equals_pqcache_kernels_cu(void)
{
    char path[600];
    size_t n = 0, i;
    char *src = read_kernel_source(&n, path, sizeof(path));
    ASSERTf(src != NULL, "pqcache_kernels.cu not found (set PQC_SOURCE_ROOT)");
    if (n != sizeof(pqc__kernel_source) - 1 || memcmp(src, pqc__kernel_source, n) != 0) {
        for (i = 0; i < n && i < sizeof(pqc__kernel_source) - 1; ++i)
            if (src[i] != pqc__kernel_source[i]) break;
        free(src);
        FAILf("the kernels embedded in pqcache.h are stale (%s: %lu bytes, embedded: %lu, first "
              "difference at byte %lu); run tools/embed_kernels.sh",
              path, (unsigned long)n, (unsigned long)(sizeof(pqc__kernel_source) - 1), (unsigned long)i);
    }
    free(src);
    ASSERTf(pqc__kernel_source[sizeof(pqc__kernel_source) - 1] == '\0', "not NUL-terminated");
    ASSERTf(strlen(pqc__kernel_source) == sizeof(pqc__kernel_source) - 1, "embedded source contains a NUL byte");
    PASS();
}

/* compiles for one target and checks the log and the kernel names */
static enum greatest_test_res compile_and_check(int arch, int cubin)
{
    void *img = NULL;
    size_t size = 0;
    char log[8192];
    int st, i;
    if (!nvrtc_ready()) SKIPf("%s", g_nv.msg);
    st = pqc__cu_compile(&g_nv, pqc__kernel_source, "pqcache_kernels.cu", arch, cubin, &img,
                         &size, log, sizeof(log));
    ASSERTf(st == PQC__CU_OK, "%s_%d: %.400s\n%.500s", cubin ? "sm" : "compute", arch, g_nv.msg, log);
    if (log[0] && (contains_ci(log, "warning") || contains_ci(log, "error"))) {
        pqc__cu_free(&g_nv, img);
        FAILf("%s_%d: compiler log is not clean:\n%.900s", cubin ? "sm" : "compute", arch, log);
    }
    ASSERTf(img != NULL && size > 64, "empty output");
    if (cubin) {
        if (memcmp(img, "\177ELF", 4) != 0) {
            pqc__cu_free(&g_nv, img);
            FAILf("sm_%d output is not an ELF cubin", arch);
        }
        for (i = 0; i < N_KERNELS; ++i) {
            if (!image_has_symbol(img, size, k_kernels[i])) {
                pqc__cu_free(&g_nv, img);
                FAILf("sm_%d cubin lacks kernel %s", arch, k_kernels[i]);
            }
        }
    } else {
        const char *ptx = (const char *)img;
        char target[32];
        ASSERTf(ptx[size - 1] == '\0', "PTX is not NUL-terminated");
        snprintf(target, sizeof(target), ".target sm_%d", arch);
        if (!strstr(ptx, target)) {
            pqc__cu_free(&g_nv, img);
            FAILf("PTX lacks \"%s\"", target);
        }
        for (i = 0; i < N_KERNELS; ++i) {
            char entry[96];
            snprintf(entry, sizeof(entry), ".entry %s(", k_kernels[i]);
            if (!strstr(ptx, entry)) {
                pqc__cu_free(&g_nv, img);
                FAILf("compute_%d PTX lacks \"%s\"", arch, entry);
            }
        }
    }
    pqc__cu_free(&g_nv, img);
    PASS();
}

/* NVRTC compiles the kernels for sm_80 and sm_90 (cubin) and compute_80 / compute_90
   (PTX) with a log free of warnings, and every kernel the backend uses is in the output */
TEST sm80_cubin_compiles_cleanly_with_every_kernel(void) { return compile_and_check(80, 1); }
TEST sm90_cubin_compiles_cleanly_with_every_kernel(void) { return compile_and_check(90, 1); }
TEST compute80_ptx_compiles_cleanly_with_every_kernel(void) { return compile_and_check(80, 0); }
TEST compute90_ptx_compiles_cleanly_with_every_kernel(void) { return compile_and_check(90, 0); }

/* a broken source gives PQC__CU_ERR_COMPILE, a log naming the error and a message naming
   the target */
TEST compile_error_returns_a_log_that_names_it(void)
{
    static const char bad[] = "extern \"C\" __global__ void k(int *p) { p[0] = undefined_name; }\n";
    void *img = NULL;
    size_t size = 0;
    char log[4096];
    int st;
    if (!nvrtc_ready()) SKIPf("%s", g_nv.msg);
    st = pqc__cu_compile(&g_nv, bad, "bad.cu", 80, 1, &img, &size, log, sizeof(log));
    ASSERTf(st == PQC__CU_ERR_COMPILE, "status %d (%s)", st, g_nv.msg);
    ASSERTf(img == NULL && size == 0, "output set on failure");
    ASSERTf(strstr(log, "undefined_name") != NULL, "log does not name the error: %.900s", log);
    ASSERTf(strstr(g_nv.msg, "sm_80") != NULL, "message: %s", g_nv.msg);
    /* a log buffer of one byte is left empty, not overrun */
    st = pqc__cu_compile(&g_nv, bad, "bad.cu", 80, 1, &img, &size, log, 1);
    ASSERTf(st == PQC__CU_ERR_COMPILE && log[0] == '\0', "one-byte log");
    PASS();
}

/* architecture choice against the NVRTC in use: a cubin for an architecture it knows,
   PTX for its newest for a newer GPU, an error naming an older one */
TEST arch_is_cubin_when_known_ptx_of_the_newest_when_newer_refused_when_older(void)
{
    int arch = 0, cubin = -1, st, n = 0, archs[128], newest;
    if (!nvrtc_ready()) SKIPf("%s", g_nv.msg);
    if (!g_nv.nvrtcGetSupportedArchs)
        SKIPf("NVRTC %d.%d lists no architectures", g_nv.nvrtc_major, g_nv.nvrtc_minor);
    ASSERTf(g_nv.nvrtcGetNumSupportedArchs(&n) == 0 && n > 0 && n <= 128, "arch count %d", n);
    ASSERTf(g_nv.nvrtcGetSupportedArchs(archs) == 0, "arch list");
    newest = archs[n - 1];
    st = pqc__cu_pick_arch(&g_nv, 90, &arch, &cubin);
    ASSERTf(st == PQC__CU_OK && arch == 90 && cubin == 1, "sm_90: st %d arch %d cubin %d", st,
            arch, cubin);
    /* a GPU newer than this NVRTC knows: PTX for the newest architecture it has */
    st = pqc__cu_pick_arch(&g_nv, newest + 7, &arch, &cubin);
    ASSERTf(st == PQC__CU_OK && arch == newest && cubin == 0, "future GPU: st %d arch %d cubin %d",
            st, arch, cubin);
    /* a GPU older than NVRTC supports */
    st = pqc__cu_pick_arch(&g_nv, 30, &arch, &cubin);
    ASSERTf(st == PQC__CU_ERR_ARCH, "sm_30: st %d", st);
    ASSERTf(strstr(g_nv.msg, "sm_30") != NULL, "message: %s", g_nv.msg);
    PASS();
}

/* without a driver, loading fails with "no CUDA driver (libcuda.so.1 not found)" and
   leaves nothing loaded */
TEST without_a_driver_loading_fails_with_no_cuda_driver(void)
{
    pqc__cuApi api;
    void *probe = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    const char *named = getenv("PQC_CUDA_DRIVER_PATH");
    char saved[4096];
    int st;
    if (probe) dlclose(probe);
    if (probe != NULL) SKIPf("a CUDA driver is installed here: the no-driver message cannot be observed");
    /* a driver named in the environment (the CPU stand-in) is not the default one */
    saved[0] = 0;
    if (named) {
        snprintf(saved, sizeof saved, "%s", named);
        unsetenv("PQC_CUDA_DRIVER_PATH");
    }
    api_init(&api);
    st = pqc__cu_load(&api, 1);
    ASSERTf(st == PQC__CU_ERR_NO_DRIVER, "status %d (%s)", st, api.msg);
    ASSERTf(strcmp(api.msg, "no CUDA driver (libcuda.so.1 not found)") == 0, "message: %s",
            api.msg);
    ASSERTf(api.lib_driver == NULL && api.lib_nvrtc == NULL && api.lib_blaslt == NULL,
            "a library stayed loaded");
    ASSERTf(api.cuInit == NULL && api.nvrtcCompileProgram == NULL, "table not cleared");
    /* the table was not touched beyond the message: loading again gives the same answer */
    st = pqc__cu_load(&api, 0);
    ASSERTf(st == PQC__CU_ERR_NO_DRIVER, "second load: status %d", st);
    pqc__cu_unload(&api);
    if (saved[0]) setenv("PQC_CUDA_DRIVER_PATH", saved, 1);
    PASS();
}

/* a library that lacks the symbols fails cleanly, naming the first missing one and the
   library; a name that does not load is no driver */
TEST driver_lacking_a_symbol_fails_naming_symbol_and_library(void)
{
    static const char *const names[] = { "libpqc-does-not-exist.so.1", "libm.so.6" };
    pqc__cuApi api;
    int st;
    api_init(&api);
    st = pqc__cu_open_driver(&api, names, 2);
    ASSERTf(st == PQC__CU_ERR_DRIVER_SYMBOL, "status %d (%s)", st, api.msg);
    ASSERTf(strstr(api.msg, "lacks symbol cuInit") != NULL, "message: %s", api.msg);
    ASSERTf(strstr(api.msg, "libm.so.6") != NULL, "message does not name the library: %s",
            api.msg);
    ASSERTf(api.lib_driver == NULL && api.cuInit == NULL && api.cuMemAlloc_v2 == NULL,
            "table not cleared");
    /* none of the names loads */
    st = pqc__cu_open_driver(&api, names, 1);
    ASSERTf(st == PQC__CU_ERR_NO_DRIVER, "status %d", st);
    ASSERTf(strcmp(api.msg, "no CUDA driver (libpqc-does-not-exist.so.1 not found)") == 0,
            "message: %s", api.msg);
    pqc__cu_unload(&api);
    PASS();
}

/* NVRTC and cuBLASLt libraries that lack the symbols fail cleanly, naming the first
   missing one */
TEST nvrtc_and_cublaslt_lacking_a_symbol_fail_naming_it(void)
{
    static const char *const libm[] = { "libm.so.6" };
    pqc__cuApi api;
    int st;
    api_init(&api);
    st = pqc__cu_open_nvrtc(&api, libm, 1);
    ASSERTf(st == PQC__CU_ERR_NVRTC_SYMBOL, "nvrtc status %d (%s)", st, api.msg);
    ASSERTf(strstr(api.msg, "lacks symbol nvrtcVersion") != NULL, "message: %s", api.msg);
    ASSERTf(api.lib_nvrtc == NULL && api.nvrtcVersion == NULL, "nvrtc table not cleared");
    st = pqc__cu_open_blaslt(&api, libm, 1);
    ASSERTf(st == PQC__CU_ERR_CUBLASLT_SYMBOL, "cublasLt status %d (%s)", st, api.msg);
    ASSERTf(strstr(api.msg, "lacks symbol cublasLtCreate") != NULL, "message: %s", api.msg);
    ASSERTf(api.lib_blaslt == NULL && api.cublasLtCreate == NULL, "blaslt table not cleared");
    pqc__cu_unload(&api);
    PASS();
}

/* the real cuBLASLt resolves completely (no device needed to load it) and unloads */
TEST cublaslt_resolves_every_function_and_unloads(void)
{
    pqc__cuApi api;
    int st;
    api_init(&api);
    st = pqc__cu_load_blaslt(&api);
    if (st == PQC__CU_ERR_NO_CUBLASLT) SKIPf("%s", api.msg);
    ASSERTf(st == PQC__CU_OK, "status %d (%s)", st, api.msg);
    ASSERTf(api.cublasLtMatmul != NULL && api.cublasLtMatmulAlgoGetHeuristic != NULL,
            "functions not resolved");
    ASSERTf(api.blaslt_version >= 110000, "cublasLtGetVersion %lu",
            (unsigned long)api.blaslt_version);
    pqc__cu_unload(&api);
    ASSERTf(api.lib_blaslt == NULL && api.cublasLtMatmul == NULL, "unload left entries");
    PASS();
}

/* the toolkit's stub libcuda has every symbol but cuInit reports CUDA_ERROR_STUB_LIBRARY:
   recognised as a stub */
TEST toolkit_stub_libcuda_resolves_but_is_reported_as_a_stub(void)
{
    static const char *const names[] = { "/usr/local/cuda/lib64/stubs/libcuda.so" };
    pqc__cuApi api;
    int st;
    api_init(&api);
    st = pqc__cu_open_driver(&api, names, 1);
    if (st == PQC__CU_ERR_NO_DRIVER) SKIPf("no stub library at %s", names[0]);
    ASSERTf(st == PQC__CU_OK, "open: status %d (%s)", st, api.msg);
    ASSERTf(api.cuLaunchKernel != NULL && api.cuEventElapsedTime != NULL &&
            api.cuMemHostGetDevicePointer_v2 != NULL, "functions not resolved");
    st = pqc__cu_init_driver(&api);
    ASSERTf(st == PQC__CU_ERR_DRIVER_INIT, "init: status %d (%s)", st, api.msg);
    ASSERTf(strstr(api.msg, "stub library") != NULL, "message: %s", api.msg);
    pqc__cu_unload(&api);
    PASS();
}

/* FNV-1a 64, the kernel cache's hash */
TEST fnv1a64_gives_the_published_vectors_and_chains(void)
{
    /* published FNV-1a 64 test vectors */
    ASSERTf(pqc__fnv("", 0, PQC__FNV_OFFSET) == 0xcbf29ce484222325ull, "empty");
    ASSERTf(pqc__fnv("a", 1, PQC__FNV_OFFSET) == 0xaf63dc4c8601ec8cull, "\"a\"");
    ASSERTf(pqc__fnv("foobar", 6, PQC__FNV_OFFSET) == 0x85944171f73967e8ull, "foobar");
    /* chaining equals hashing the concatenation */
    ASSERTf(pqc__fnv("bar", 3, pqc__fnv("foo", 3, PQC__FNV_OFFSET)) ==
                0x85944171f73967e8ull, "chained");
    PASS();
}

/* a compiled image's key is stable and changes with the source, the architecture, cubin
   or PTX, and the NVRTC version */
TEST cache_key_changes_with_source_arch_output_and_nvrtc_version(void)
{
    pqc__cuApi api;
    uint64_t k1, k2, k3, k4;
    api_init(&api);
    api.nvrtc_major = 13;
    api.nvrtc_minor = 0;
    k1 = pqc__cu_cache_key(&api, "source A", 90, 1);
    k2 = pqc__cu_cache_key(&api, "source B", 90, 1);
    k3 = pqc__cu_cache_key(&api, "source A", 80, 1);
    k4 = pqc__cu_cache_key(&api, "source A", 90, 0);
    ASSERTf(k1 != k2 && k1 != k3 && k1 != k4, "keys collide");
    ASSERTf(k1 == pqc__cu_cache_key(&api, "source A", 90, 1), "key not stable");
    api.nvrtc_minor = 1;
    ASSERTf(k1 != pqc__cu_cache_key(&api, "source A", 90, 1), "NVRTC version not in key");
    PASS();
}

/* a compiled image's file is named by key, architecture, cubin or PTX and NVRTC version;
   a buffer too small for the name is refused */
TEST cache_path_names_key_arch_output_and_nvrtc_version(void)
{
    pqc__cuApi api;
    char path[600];
    api_init(&api);
    api.nvrtc_major = 13;
    api.nvrtc_minor = 0;
    ASSERTf(pqc__cu_cache_path(&api, "/c", 0x0123456789abcdefull, 90, 1, path, sizeof(path)) == 0,
            "path");
    ASSERTf(strcmp(path, "/c/pqc-0123456789abcdef-sm90-nvrtc13.0.cubin") == 0, "path %s", path);
    ASSERTf(pqc__cu_cache_path(&api, "/c", 1, 86, 0, path, sizeof(path)) == 0 &&
                strcmp(path, "/c/pqc-0000000000000001-compute86-nvrtc13.0.ptx") == 0,
            "path %s", path);
    ASSERTf(pqc__cu_cache_path(&api, "/c", 1, 86, 0, path, g_small) == -1,
            "overlong path accepted");
    PASS();
}

static int remove_tree_entry(const char *dir, const char *name)
{
    char p[700];
    snprintf(p, sizeof(p), "%s/%s", dir, name);
    return remove(p);
}

/* the kernel cache is the directory given, else $XDG_CACHE_HOME/pqcache, else
   $HOME/.cache/pqcache, created */
TEST cache_dir_is_the_given_one_else_xdg_cache_home_else_home_and_is_made(void)
{
    pqc__cuApi api;
    char base[] = "/tmp/pqc_nvrtc_dirXXXXXX";
    char out[512], want[600], xdg_old[512], home_old[512];
    const char *x, *h;
    int had_xdg, had_home, ok1, ok2, ok3;
    struct stat sb;
    ASSERTf(mkdtemp(base) != NULL, "mkdtemp");
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
    ASSERTf(ok1, "explicit directory");
    ASSERTf(ok2, "XDG_CACHE_HOME directory");
    ASSERTf(ok3, "HOME directory");
    PASS();
}

/* a cached image reads back as written, only under its own key, and not once damaged or
   truncated */
TEST cached_image_reads_back_only_under_its_key_and_intact(void)
{
    pqc__cuApi api;
    char dir[] = "/tmp/pqc_nvrtc_cacheXXXXXX";
    char path[600];
    unsigned char img[1000];
    void *got = NULL;
    size_t n = 0;
    int i, hit, hit_other, hit_corrupt, hit_trunc, same;
    FILE *f;
    ASSERTf(mkdtemp(dir) != NULL, "mkdtemp");
    api_init(&api);
    api.nvrtc_major = 13;
    for (i = 0; i < 1000; ++i) img[i] = (unsigned char)(i * 7 + 3);
    ASSERTf(pqc__cu_cache_path(&api, dir, 42, 90, 1, path, sizeof(path)) == 0, "path");
    ASSERTf(pqc__cu_cache_read(&api, path, 42, &got, &n) == 0 && got == NULL, "hit before write");
    ASSERTf(pqc__cu_cache_write(&api, path, 42, img, sizeof(img)) == 0, "write");
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
    ASSERTf(hit == 1 && same, "round trip");
    ASSERTf(hit_other == 0, "another key hit");
    ASSERTf(hit_corrupt == 0 && got == NULL, "corrupt file accepted");
    ASSERTf(hit_trunc == 0, "truncated file accepted");
    PASS();
}

/* without an allocator nothing is compiled, and the loader says why */
TEST compile_without_an_allocator_fails_with_alloc(void)
{
    pqc__cuApi api;
    void *img = (void *)&api;
    size_t size = 1;
    int st;
    if (!nvrtc_ready()) SKIPf("%s", g_nv.msg);
    api = g_nv;
    api.host.alloc = NULL;
    st = pqc__cu_compile(&api, pqc__kernel_source, NULL, 80, 1, &img, &size, NULL, 0);
    ASSERTf(st == PQC__CU_ERR_ALLOC && img == NULL && size == 0, "status %d (%s)", st, api.msg);
    PASS();
}

SUITE(nvrtc)
{
    RUN_TEST(embedded_kernel_source_equals_pqcache_kernels_cu);
    RUN_TEST(fnv1a64_gives_the_published_vectors_and_chains);
    RUN_TEST(cache_key_changes_with_source_arch_output_and_nvrtc_version);
    RUN_TEST(cache_path_names_key_arch_output_and_nvrtc_version);
    RUN_TEST(cache_dir_is_the_given_one_else_xdg_cache_home_else_home_and_is_made);
    RUN_TEST(cached_image_reads_back_only_under_its_key_and_intact);
    RUN_TEST(without_a_driver_loading_fails_with_no_cuda_driver);
    RUN_TEST(driver_lacking_a_symbol_fails_naming_symbol_and_library);
    RUN_TEST(nvrtc_and_cublaslt_lacking_a_symbol_fail_naming_it);
    RUN_TEST(toolkit_stub_libcuda_resolves_but_is_reported_as_a_stub);
    RUN_TEST(cublaslt_resolves_every_function_and_unloads);
    RUN_TEST(arch_is_cubin_when_known_ptx_of_the_newest_when_newer_refused_when_older);
    RUN_TEST(compile_without_an_allocator_fails_with_alloc);
    RUN_TEST(compile_error_returns_a_log_that_names_it);
    RUN_TEST(sm80_cubin_compiles_cleanly_with_every_kernel);
    RUN_TEST(sm90_cubin_compiles_cleanly_with_every_kernel);
    RUN_TEST(compute80_ptx_compiles_cleanly_with_every_kernel);
    RUN_TEST(compute90_ptx_compiles_cleanly_with_every_kernel);
}

GREATEST_MAIN_DEFS();

int main(int argc, char **argv)
{
    GREATEST_MAIN_BEGIN();
    RUN_SUITE(nvrtc);
    if (g_nv.lib_nvrtc) pqc__cu_unload(&g_nv);
    GREATEST_MAIN_END();
}
