/* tl_test.h - the small harness of tiny_llama's test programs: one line per test
   ("ok", "FAIL" or "SKIP" and its name), a temporary directory, and the closing line
   "N passed, N failed" (", N skipped" when some were). Include once, in the test file. */
#ifndef TL_TEST_H
#define TL_TEST_H

#include <stdio.h>

static int g_failed_now, g_passed, g_failed, g_skipped;
static char g_dir[512]; /* the test directory, made by the test's main */

#define CHECK(cond)                                                      \
    do {                                                                 \
        if (!(cond)) {                                                   \
            printf("  %s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
            g_failed_now = 1;                                            \
        }                                                                \
    } while (0)

/* a test that cannot run here increments g_skipped and returns */
static void run_test(const char *name, void (*fn)(void))
{
    int skipped = g_skipped;
    g_failed_now = 0;
    fn();
    if (g_failed_now)
        g_failed++;
    else if (g_skipped == skipped)
        g_passed++;
    printf("%s %s\n", g_failed_now ? "FAIL" : g_skipped != skipped ? "SKIP" : "ok  ", name);
    fflush(stdout);
}

/* a path in the test directory; valid until 8 more calls */
static const char *tmp_path(const char *name)
{
    static char paths[8][600];
    static int next;
    char *p = paths[next++ % 8];
    snprintf(p, 600, "%s/%s", g_dir, name);
    return p;
}

/* prints the closing line; returns the exit status */
static int test_summary(void)
{
    if (g_skipped)
        printf("%d passed, %d failed, %d skipped\n", g_passed, g_failed, g_skipped);
    else
        printf("%d passed, %d failed\n", g_passed, g_failed);
    return g_failed ? 1 : 0;
}

#endif
