/*
 * greatest.h - a small single-header C/C++ unit test harness.
 *
 * Implements a subset of the "greatest" test API (same macro names and
 * meaning), so test files written against it also build with the full
 * upstream greatest.h.  C99 or C++11, no compiler extensions required.
 *
 * Usage:
 *
 *     #include "greatest.h"
 *
 *     TEST adds_up(void) {
 *         ASSERT_EQ(4, 2 + 2);
 *         ASSERT_EQ_FMT(4, 2 + 2, "%d");    // prints both values on failure
 *         ASSERT_STR_EQm("names differ", "abc", name);
 *         PASS();
 *     }
 *     TEST takes_arg(int n) { ASSERT_GT(n, 0); PASS(); }
 *
 *     SUITE(math_suite) {
 *         SET_SETUP(my_setup, &fixture);       // optional: called with the
 *         SET_TEARDOWN(my_teardown, &fixture); // pointer before / after each
 *         RUN_TEST(adds_up);                   // test; reset at suite end
 *         RUN_TEST1(takes_arg, 3);             // RUN_TESTp(f, a, b) for more
 *     }
 *
 *     GREATEST_MAIN_DEFS();                    // once per program; other
 *                                              // files: SUITE_EXTERN(name);
 *     int main(int argc, char **argv) {        // names argc/argv required
 *         GREATEST_MAIN_BEGIN();               // parses the flags below
 *         RUN_SUITE(math_suite);
 *         GREATEST_MAIN_END();                 // prints report, returns
 *     }
 *
 * Test functions return enum greatest_test_res; the ASSERT/PASS/FAIL/SKIP
 * macros `return` from the enclosing test function (no longjmp), so a
 * teardown always runs.  Helpers written the same way are called with
 * CHECK_CALL(helper(args)), which returns from the caller unless the helper
 * passed.  Assertions (each fails the test with file:line and a message):
 *   ASSERT(c) ASSERT_FALSE(c) ASSERT_EQ(exp,got) ASSERT_NEQ(exp,got)
 *   ASSERT_GT/GTE/LT/LTE(a,b)  (true when a > b, a >= b, a < b, a <= b)
 *   ASSERT_EQ_FMT(exp,got,fmt) ASSERT_IN_RANGE(exp,got,tol)
 *   ASSERT_STR_EQ(exp,got) ASSERT_STRN_EQ(exp,got,n) ASSERT_MEM_EQ(exp,got,n)
 * each with an `m` variant taking a message first, e.g. ASSERTm(msg, c).
 * ASSERT_EQ_FMT evaluates its arguments twice (compare, then print).
 * Results: PASS() PASSm(msg) FAIL() FAILm(msg) SKIP() SKIPm(msg).
 *
 * Flags: -h help, -v verbose (one line per test), -l list only,
 *   -t NAME run tests whose name contains NAME, -s NAME suites only (tests
 *   run outside any suite are not affected), -x NAME exclude tests
 *   containing NAME (repeatable, up to GREATEST_MAX_EXCLUDES names), -e
 *   exact match for -t/-s, -f stop after the first failure.  Flags combine
 *   ("-vf"); values may be attached ("-tname").
 * The last line on stdout is "N passed, N failed" (", N skipped" added
 * when any test skipped); main returns EXIT_FAILURE if any test failed.
 * With GREATEST_TIMES=FILE in the environment, every test run appends one
 * line "PROGRAM<tab>SUITE.TEST<tab>SECONDS" (wall time, setup and teardown
 * included) to FILE; the test runner sorts them into a list of the slowest.
 */
#ifndef GREATEST_H
#define GREATEST_H

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifndef GREATEST_STDOUT
#define GREATEST_STDOUT stdout
#endif
#ifndef GREATEST_FLOAT
#define GREATEST_FLOAT double
#endif
#ifndef GREATEST_MAX_EXCLUDES
#define GREATEST_MAX_EXCLUDES 8
#endif

enum greatest_test_res {
    GREATEST_TEST_RES_PASS = 0,
    GREATEST_TEST_RES_FAIL = -1,
    GREATEST_TEST_RES_SKIP = 1
};

enum {
    GREATEST_FLAG_FIRST_FAIL = 0x01,
    GREATEST_FLAG_LIST_ONLY = 0x02,
    GREATEST_FLAG_EXACT_NAME_MATCH = 0x04
};

typedef void greatest_setup_cb(void *udata);
typedef void greatest_teardown_cb(void *udata);
typedef void greatest_suite_cb(void);

struct greatest_run_info {
    unsigned flags, verbosity;
    unsigned tests_run, passed, failed, skipped, assertions;  /* totals */
    unsigned suite_passed, suite_failed, suite_skipped;
    const char *suite_name;      /* NULL outside RUN_SUITE */
    int suite_shown;             /* header of current suite printed */
    const char *test_name;       /* test currently running */
    const char *msg;             /* message of the last PASSm/FAILm/SKIPm */
    const char *fail_file;
    unsigned fail_line;
    char detail[1024];           /* extra failure text (values, offsets) */
    size_t detail_len;
    unsigned col;                /* chars on the current progress line */
    const char *test_filter, *suite_filter;
    const char *test_exclude[GREATEST_MAX_EXCLUDES]; /* -x, each given */
    int n_exclude;
    greatest_setup_cb *setup;
    void *setup_udata;
    greatest_teardown_cb *teardown;
    void *teardown_udata;
    clock_t begin, suite_begin;
    const char *prog;            /* argv[0], for the timing lines */
    double test_begin;           /* wall clock at the current test's start */
};

extern struct greatest_run_info greatest_info;

/* ---- test definition and running ---- */

#define TEST static enum greatest_test_res
#define SUITE(NAME) void NAME(void); void NAME(void)
#define SUITE_EXTERN(NAME) void NAME(void)

#define RUN_TEST(TEST)                                                      \
    do { if (greatest_test_pre(#TEST)) { greatest_test_post(TEST()); } } while (0)
#define RUN_TEST1(TEST, ARG)                                                \
    do { if (greatest_test_pre(#TEST)) { greatest_test_post(TEST(ARG)); } } while (0)
/* C99 needs at least one argument after TEST. */
#define RUN_TESTp(TEST, ...)                                                \
    do { if (greatest_test_pre(#TEST)) { greatest_test_post(TEST(__VA_ARGS__)); } } while (0)
#define RUN_SUITE(S_NAME) greatest_run_suite(S_NAME, #S_NAME)

#define GREATEST_SET_SETUP_CB(CB, UDATA)                                    \
    do { greatest_info.setup = (CB); greatest_info.setup_udata = (UDATA); } while (0)
#define GREATEST_SET_TEARDOWN_CB(CB, UDATA)                                 \
    do { greatest_info.teardown = (CB); greatest_info.teardown_udata = (UDATA); } while (0)
#define SET_SETUP GREATEST_SET_SETUP_CB
#define SET_TEARDOWN GREATEST_SET_TEARDOWN_CB

#define GREATEST_MAIN_DEFS() struct greatest_run_info greatest_info
#define GREATEST_INIT() greatest_init()
#define GREATEST_PRINT_REPORT() greatest_print_report()
#define GREATEST_IS_VERBOSE() (greatest_info.verbosity > 0)
#define GREATEST_MAIN_BEGIN()                                               \
    do { greatest_init(); greatest_parse_options(argc, argv); } while (0)
#define GREATEST_MAIN_END()                                                 \
    do {                                                                    \
        greatest_print_report();                                            \
        return greatest_all_passed() ? EXIT_SUCCESS : EXIT_FAILURE;         \
    } while (0)

/* ---- results ---- */

#define PASSm(MSG) do { greatest_info.msg = (MSG); return GREATEST_TEST_RES_PASS; } while (0)
#define SKIPm(MSG) do { greatest_info.msg = (MSG); return GREATEST_TEST_RES_SKIP; } while (0)
#define FAILm(MSG)                                                          \
    do { greatest_info.detail_len = 0; GREATEST_FAILd_(MSG); } while (0)
#define PASS() PASSm(NULL)
#define SKIP() SKIPm(NULL)
#define FAIL() FAILm(NULL)
/* Internal: fail, keeping the detail text an assertion just wrote. */
#define GREATEST_FAILd_(MSG)                                                \
    do {                                                                    \
        greatest_info.msg = (MSG);                                          \
        greatest_info.fail_file = __FILE__;                                 \
        greatest_info.fail_line = __LINE__;                                 \
        return GREATEST_TEST_RES_FAIL;                                      \
    } while (0)

#define CHECK_CALL(RES)                                                     \
    do {                                                                    \
        enum greatest_test_res greatest_res_ = (RES);                       \
        if (greatest_res_ != GREATEST_TEST_RES_PASS) { return greatest_res_; } \
    } while (0)

/* ---- assertions ---- */

#define ASSERTm(MSG, COND)                                                  \
    do { greatest_info.assertions++; if (!(COND)) { FAILm(MSG); } } while (0)
#define ASSERT_FALSEm(MSG, COND) ASSERTm(MSG, !(COND))
#define ASSERT_EQm(MSG, EXP, GOT) ASSERTm(MSG, (EXP) == (GOT))
#define ASSERT_NEQm(MSG, EXP, GOT) ASSERTm(MSG, (EXP) != (GOT))
#define ASSERT_GTm(MSG, EXP, GOT) ASSERTm(MSG, (EXP) > (GOT))
#define ASSERT_GTEm(MSG, EXP, GOT) ASSERTm(MSG, (EXP) >= (GOT))
#define ASSERT_LTm(MSG, EXP, GOT) ASSERTm(MSG, (EXP) < (GOT))
#define ASSERT_LTEm(MSG, EXP, GOT) ASSERTm(MSG, (EXP) <= (GOT))

#define ASSERT(COND) ASSERTm(#COND, COND)
#define ASSERT_FALSE(COND) ASSERT_FALSEm(#COND " != false", COND)
#define ASSERT_EQ(EXP, GOT) ASSERT_EQm(#EXP " != " #GOT, EXP, GOT)
#define ASSERT_NEQ(EXP, GOT) ASSERT_NEQm(#EXP " == " #GOT, EXP, GOT)
#define ASSERT_GT(EXP, GOT) ASSERT_GTm(#EXP " <= " #GOT, EXP, GOT)
#define ASSERT_GTE(EXP, GOT) ASSERT_GTEm(#EXP " < " #GOT, EXP, GOT)
#define ASSERT_LT(EXP, GOT) ASSERT_LTm(#EXP " >= " #GOT, EXP, GOT)
#define ASSERT_LTE(EXP, GOT) ASSERT_LTEm(#EXP " > " #GOT, EXP, GOT)

#define ASSERT_EQ_FMTm(MSG, EXP, GOT, FMT)                                  \
    do {                                                                    \
        greatest_info.assertions++;                                         \
        if ((EXP) != (GOT)) {                                               \
            greatest_info.detail_len = 0;                                   \
            greatest_detailf("  Expected: ");                               \
            greatest_detailf(FMT, EXP);                                     \
            greatest_detailf("\n       Got: ");                             \
            greatest_detailf(FMT, GOT);                                     \
            greatest_detailf("\n");                                         \
            GREATEST_FAILd_(MSG);                                           \
        }                                                                   \
    } while (0)
#define ASSERT_EQ_FMT(EXP, GOT, FMT) ASSERT_EQ_FMTm(#EXP " != " #GOT, EXP, GOT, FMT)

/* Internal: count an assertion; fail keeping the detail CHECK wrote. */
#define GREATEST_CHECK_(MSG, CHECK)                                         \
    do { greatest_info.assertions++; if (!(CHECK)) { GREATEST_FAILd_(MSG); } } while (0)

#define ASSERT_IN_RANGEm(MSG, EXP, GOT, TOL)                                \
    GREATEST_CHECK_(MSG, greatest_in_range((GREATEST_FLOAT)(EXP),           \
                                           (GREATEST_FLOAT)(GOT), (GREATEST_FLOAT)(TOL)))
#define ASSERT_IN_RANGE(EXP, GOT, TOL)                                      \
    ASSERT_IN_RANGEm(#EXP " != " #GOT " +/- " #TOL, EXP, GOT, TOL)
#define ASSERT_STR_EQm(MSG, EXP, GOT)                                       \
    GREATEST_CHECK_(MSG, greatest_str_eq((EXP), (GOT), 0, 0))
#define ASSERT_STR_EQ(EXP, GOT) ASSERT_STR_EQm(#EXP " != " #GOT, EXP, GOT)
#define ASSERT_STRN_EQm(MSG, EXP, GOT, N)                                   \
    GREATEST_CHECK_(MSG, greatest_str_eq((EXP), (GOT), (N), 1))
#define ASSERT_STRN_EQ(EXP, GOT, N) ASSERT_STRN_EQm(#EXP " != " #GOT, EXP, GOT, N)
#define ASSERT_MEM_EQm(MSG, EXP, GOT, SIZE)                                 \
    GREATEST_CHECK_(MSG, greatest_mem_eq((EXP), (GOT), (SIZE)))
#define ASSERT_MEM_EQ(EXP, GOT, SIZE) ASSERT_MEM_EQm(#EXP " != " #GOT, EXP, GOT, SIZE)

/* ---- implementation (static inline: usable from several files) ---- */

#if defined(__GNUC__) || defined(__clang__)
static inline void greatest_detailf(const char *fmt, ...)
    __attribute__((format(printf, 1, 2)));
#endif

/* Append printf-style text to the failure detail buffer (truncating). */
static inline void greatest_detailf(const char *fmt, ...) {
    struct greatest_run_info *g = &greatest_info;
    size_t room = sizeof(g->detail) - g->detail_len;
    va_list ap;
    int n;
    if (room <= 1) { return; }
    va_start(ap, fmt);
    n = vsnprintf(g->detail + g->detail_len, room, fmt, ap);
    va_end(ap);
    if (n > 0) { g->detail_len += ((size_t)n < room) ? (size_t)n : room - 1; }
}

static inline int greatest_in_range(GREATEST_FLOAT want, GREATEST_FLOAT got,
                                    GREATEST_FLOAT tol) {
    GREATEST_FLOAT diff = want > got ? want - got : got - want;
    if (diff <= tol) { return 1; }      /* false for NaN, too */
    greatest_info.detail_len = 0;
    greatest_detailf("  Expected: %g +/- %g\n       Got: %g\n",
                     (double)want, (double)tol, (double)got);
    return 0;
}

static inline int greatest_str_eq(const char *want, const char *got,
                                  size_t n, int bounded) {
    int prec = (bounded && n < 0x7fff) ? (int)n : 0x7fff;
    if (want == got) { return 1; }
    if (want != NULL && got != NULL &&
        (bounded ? strncmp(want, got, n) : strcmp(want, got)) == 0) {
        return 1;
    }
    greatest_info.detail_len = 0;
    greatest_detailf("  Expected: %s%.*s%s\n", want ? "\"" : "", prec,
                     want ? want : "(null)", want ? "\"" : "");
    greatest_detailf("       Got: %s%.*s%s\n", got ? "\"" : "", prec,
                     got ? got : "(null)", got ? "\"" : "");
    return 0;
}

static inline int greatest_mem_eq(const void *want, const void *got, size_t size) {
    const unsigned char *e = (const unsigned char *)want;
    const unsigned char *g = (const unsigned char *)got;
    size_t i, j;
    if (size == 0 || want == got) { return 1; }
    greatest_info.detail_len = 0;
    if (e == NULL || g == NULL) {
        greatest_detailf("  %s is NULL (size %lu)\n", e ? "Got" : "Expected",
                         (unsigned long)size);
        return 0;
    }
    if (memcmp(e, g, size) == 0) { return 1; }
    for (i = 0; e[i] == g[i]; i++) {}
    greatest_detailf("  First difference at offset %lu of %lu\n",
                     (unsigned long)i, (unsigned long)size);
    greatest_detailf("  Expected:");
    for (j = i; j < size && j < i + 8; j++) { greatest_detailf(" %02x", e[j]); }
    greatest_detailf("\n       Got:");
    for (j = i; j < size && j < i + 8; j++) { greatest_detailf(" %02x", g[j]); }
    greatest_detailf("\n");
    return 0;
}

static inline int greatest_name_match(const char *name, const char *filter,
                                      int exact) {
    if (filter == NULL) { return 1; }
    return exact ? strcmp(name, filter) == 0 : strstr(name, filter) != NULL;
}

static inline void greatest_newline_if_needed(void) {
    if (greatest_info.col > 0) { fputc('\n', GREATEST_STDOUT); }
    greatest_info.col = 0;
}

/* Seconds on a monotonic clock where POSIX has one (the including file defined
 * _POSIX_C_SOURCE), else processor time. */
static inline double greatest_wall(void) {
#if defined(_POSIX_C_SOURCE) && _POSIX_C_SOURCE >= 199309L && defined(CLOCK_MONOTONIC)
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) == 0) {
        return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
    }
#endif
    return (double)clock() / CLOCKS_PER_SEC;
}

/* Appends the finished test's wall time to $GREATEST_TIMES, when set. */
static inline void greatest_log_time(void) {
    struct greatest_run_info *g = &greatest_info;
    const char *path = getenv("GREATEST_TIMES");
    FILE *f;
    if (path == NULL || path[0] == '\0') { return; }
    f = fopen(path, "a");
    if (f == NULL) { return; }
    fprintf(f, "%s\t%s%s%s\t%.3f\n", g->prog ? g->prog : "test",
            g->suite_name ? g->suite_name : "", g->suite_name ? "." : "",
            g->test_name, greatest_wall() - g->test_begin);
    fclose(f);
}

/* Decides whether to run the named test; runs setup if so. */
static inline int greatest_test_pre(const char *name) {
    struct greatest_run_info *g = &greatest_info;
    int exact = (g->flags & GREATEST_FLAG_EXACT_NAME_MATCH) != 0;
    int list = (g->flags & GREATEST_FLAG_LIST_ONLY) != 0;
    int i;
    if (!greatest_name_match(name, g->test_filter, exact)) { return 0; }
    for (i = 0; i < g->n_exclude; i++) {
        if (strstr(name, g->test_exclude[i]) != NULL) { return 0; }
    }
    if ((g->flags & GREATEST_FLAG_FIRST_FAIL) && g->failed > 0) { return 0; }
    if (g->suite_name != NULL && !g->suite_shown) {
        greatest_newline_if_needed();
        fprintf(GREATEST_STDOUT, list ? "* Suite %s:\n" : "\n* Suite %s:\n",
                g->suite_name);
        g->suite_shown = 1;
    }
    if (list) {
        fprintf(GREATEST_STDOUT, "%s%s\n", g->suite_name ? "  " : "", name);
        return 0;
    }
    g->test_name = name;
    g->msg = NULL;
    g->fail_file = NULL;
    g->fail_line = 0;
    g->detail_len = 0;
    g->detail[0] = '\0';
    g->test_begin = greatest_wall();
    if (g->setup != NULL) { g->setup(g->setup_udata); }
    return 1;
}

/* Runs teardown, records and prints the result of the test just run. */
static inline void greatest_test_post(enum greatest_test_res res) {
    struct greatest_run_info *g = &greatest_info;
    FILE *out = GREATEST_STDOUT;
    const char *msg = g->msg;
    if (g->teardown != NULL) { g->teardown(g->teardown_udata); }
    greatest_log_time();
    g->tests_run++;
    if (res == GREATEST_TEST_RES_FAIL) {
        g->failed++; g->suite_failed++;
        greatest_newline_if_needed();
        fprintf(out, "FAIL %s%s%s (%s:%u)\n", g->test_name, msg ? ": " : "",
                msg ? msg : "", g->fail_file ? g->fail_file : "unknown",
                g->fail_line);
        if (g->detail_len > 0) { fputs(g->detail, out); }
    } else if (g->verbosity > 0) {
        fprintf(out, "%s %s%s%s\n", res == GREATEST_TEST_RES_SKIP ? "SKIP" : "PASS",
                g->test_name, msg ? ": " : "", msg ? msg : "");
    } else {
        fputc(res == GREATEST_TEST_RES_SKIP ? 's' : '.', out);
        if (++g->col >= 72) { greatest_newline_if_needed(); }
    }
    if (res == GREATEST_TEST_RES_SKIP) {
        g->skipped++; g->suite_skipped++;
    } else if (res != GREATEST_TEST_RES_FAIL) {
        g->passed++; g->suite_passed++;
    }
    g->test_name = NULL;
    fflush(out);
}

static inline void greatest_run_suite(greatest_suite_cb *suite, const char *name) {
    struct greatest_run_info *g = &greatest_info;
    int exact = (g->flags & GREATEST_FLAG_EXACT_NAME_MATCH) != 0;
    if (!greatest_name_match(name, g->suite_filter, exact)) { return; }
    if ((g->flags & GREATEST_FLAG_FIRST_FAIL) && g->failed > 0) { return; }
    g->suite_name = name;
    g->suite_shown = 0;
    g->suite_passed = g->suite_failed = g->suite_skipped = 0;
    g->suite_begin = clock();
    suite();
    if (g->suite_shown && !(g->flags & GREATEST_FLAG_LIST_ONLY)) {
        greatest_newline_if_needed();
        fprintf(GREATEST_STDOUT, "%u tests - %u passed, %u failed, %u skipped (%.3f sec)\n",
                g->suite_passed + g->suite_failed + g->suite_skipped,
                g->suite_passed, g->suite_failed, g->suite_skipped,
                (double)(clock() - g->suite_begin) / CLOCKS_PER_SEC);
    }
    g->suite_name = NULL;
    g->setup = NULL; g->setup_udata = NULL;
    g->teardown = NULL; g->teardown_udata = NULL;
}

static inline void greatest_init(void) {
    memset(&greatest_info, 0, sizeof(greatest_info));
    greatest_info.begin = clock();
}

static inline void greatest_usage(FILE *out, const char *prog) {
    fprintf(out, "Usage: %s [-hvlfe] [-t TEST] [-s SUITE] [-x EXCLUDE]\n"
            "  -h help   -v verbose   -l list only   -f stop at first failure\n"
            "  -t TEST   only tests whose name contains TEST\n"
            "  -s SUITE  only suites whose name contains SUITE\n"
            "  -x NAME   skip tests whose name contains NAME (repeatable)\n"
            "  -e        -t and -s need an exact name match\n", prog);
}

static inline void greatest_parse_options(int argc, char **argv) {
    struct greatest_run_info *g = &greatest_info;
    const char *prog = argc > 0 ? argv[0] : "test";
    int i;
    g->prog = prog;
    for (i = 1; i < argc; i++) {
        const char *a = argv[i];
        int j, took_value = 0;
        if (strcmp(a, "--") == 0) { break; }
        if (strcmp(a, "--help") == 0) { greatest_usage(stdout, prog); exit(EXIT_SUCCESS); }
        if (a[0] != '-' || a[1] == '\0') {
            fprintf(stderr, "Unexpected argument: %s\n", a);
            greatest_usage(stderr, prog);
            exit(EXIT_FAILURE);
        }
        for (j = 1; a[j] != '\0' && !took_value; j++) {
            const char *value;
            switch (a[j]) {
            case 'h': greatest_usage(stdout, prog); exit(EXIT_SUCCESS);
            case 'v': g->verbosity++; break;
            case 'l': g->flags |= GREATEST_FLAG_LIST_ONLY; break;
            case 'f': g->flags |= GREATEST_FLAG_FIRST_FAIL; break;
            case 'e': g->flags |= GREATEST_FLAG_EXACT_NAME_MATCH; break;
            case 't': case 's': case 'x':
                value = a[j + 1] != '\0' ? &a[j + 1] : (i + 1 < argc ? argv[++i] : NULL);
                if (value == NULL) {
                    fprintf(stderr, "Option -%c needs an argument\n", a[j]);
                    greatest_usage(stderr, prog);
                    exit(EXIT_FAILURE);
                }
                if (a[j] == 't') { g->test_filter = value; }
                else if (a[j] == 's') { g->suite_filter = value; }
                else if (g->n_exclude < GREATEST_MAX_EXCLUDES) { g->test_exclude[g->n_exclude++] = value; }
                else {
                    fprintf(stderr, "Option -x: at most %d names\n", GREATEST_MAX_EXCLUDES);
                    exit(EXIT_FAILURE);
                }
                took_value = 1;
                break;
            default:
                fprintf(stderr, "Unknown option: -%c\n", a[j]);
                greatest_usage(stderr, prog);
                exit(EXIT_FAILURE);
            }
        }
    }
}

static inline int greatest_all_passed(void) { return greatest_info.failed == 0; }

static inline void greatest_print_report(void) {
    struct greatest_run_info *g = &greatest_info;
    FILE *out = GREATEST_STDOUT;
    if (g->flags & GREATEST_FLAG_LIST_ONLY) { return; }
    greatest_newline_if_needed();
    fprintf(out, "\nTotal: %u tests (%.3f sec), %u assertions\n", g->tests_run,
            (double)(clock() - g->begin) / CLOCKS_PER_SEC, g->assertions);
    if (g->skipped > 0) {
        fprintf(out, "%u passed, %u failed, %u skipped\n", g->passed, g->failed, g->skipped);
    } else {
        fprintf(out, "%u passed, %u failed\n", g->passed, g->failed);
    }
    fflush(out);
}

#endif /* GREATEST_H */
