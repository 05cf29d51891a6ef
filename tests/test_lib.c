/* test_lib.c - the library's test programs (test_core, test_cache, test_contract,
 * test_fidelity, test_golden, test_kernels) as one program: the header's implementation
 * compiled once instead of six times, for every build make test runs them in (plain, the
 * sanitizers, without threads, the cross build). PQC_TEST_SUITES (environment): the suites
 * to run, separated by spaces (default: all six); greatest's own options as in each
 * program (-t, -x, -v, ...). */
#define PQC_TEST_UNITY
#define g_rng g_rng_core
#include "test_core.c"
#undef g_rng
#define g_rng g_rng_cache
#include "test_cache.c"
#undef g_rng
#define g_rng g_rng_contract
#include "test_contract.c"
#undef g_rng
#define g_rng g_rng_fidelity
#include "test_fidelity.c"
#undef g_rng
#define g_rng g_rng_golden
#include "test_golden.c"
#undef g_rng
#define g_rng g_rng_kernels
#include "test_kernels.c"
#undef g_rng

GREATEST_MAIN_DEFS();

/* 1 when suite `name` is among PQC_TEST_SUITES (or the variable is unset or empty) */
static int tl_wanted(const char *name)
{
    const char *w = getenv("PQC_TEST_SUITES"), *p;
    size_t n = strlen(name);
    if (!w || !*w) return 1;
    for (p = w; (p = strstr(p, name)) != NULL; p += n)
        if ((p == w || p[-1] == ' ') && (p[n] == '\0' || p[n] == ' ')) return 1;
    return 0;
}

int main(int argc, char **argv)
{
    GREATEST_MAIN_BEGIN();
    if (tl_wanted("core")) RUN_SUITE(core);
    if (tl_wanted("cache")) RUN_SUITE(cache);
    if (tl_wanted("contract")) RUN_SUITE(contract);
    if (tl_wanted("fidelity")) RUN_SUITE(fidelity);
    if (tl_wanted("golden")) RUN_SUITE(golden);
    if (tl_wanted("kernels")) RUN_SUITE(kernels);
    GREATEST_MAIN_END();
}
