/*
 * Self-test for tests/greatest.h.
 *
 * A normal run exercises every macro on passing values, checks setup /
 * teardown, argument-taking tests and skips, and calls each deliberately
 * failing test directly to prove the assertion really returns FAIL with
 * the expected message and details.  With HARNESS_SELFTEST_FAIL=1 the
 * deliberately failing tests also run through the harness, so the run must
 * report failures and exit non-zero.  tests/harness_selftest.sh automates:
 *
 *   cc -std=c99 -Wall -Wextra -Werror -pedantic -Itests \
 *      tests/test_harness.c -o test_harness
 *   ./test_harness; echo "exit $?"                          # N passed, 0 failed...
 *   HARNESS_SELFTEST_FAIL=1 ./test_harness; echo "exit $?"  # ..., 18 failed, ...
 *   ./test_harness -l; ./test_harness -v -t asserts_ -x strings
 */
#include <stdlib.h>
#include <string.h>

#include "greatest.h"

static int one = 1, two = 2, forty_two = 42;

/* ---- passing uses of every macro ---- */

TEST asserts_basic(void) {
    ASSERT(one == 1);
    ASSERTm("one is one", one == 1);
    ASSERT_FALSE(one == 2);
    ASSERT_FALSEm("one is not two", one == 2);
    PASS();
}

TEST asserts_compare(void) {
    ASSERT_EQ(1, one);
    ASSERT_EQm("two", 2, two);
    ASSERT_NEQ(one, two);
    ASSERT_NEQm("differ", one, two);
    ASSERT_GT(two, one);
    ASSERT_GTm("gt", two, one);
    ASSERT_GTE(two, two);
    ASSERT_GTEm("gte", two, one);
    ASSERT_LT(one, two);
    ASSERT_LTm("lt", one, two);
    ASSERT_LTE(one, one);
    ASSERT_LTEm("lte", one, two);
    PASS();
}

TEST asserts_eq_fmt(void) {
    unsigned long big = 4000000000UL;
    ASSERT_EQ_FMT(42, forty_two, "%d");
    ASSERT_EQ_FMT(4000000000UL, big, "%lu");
    ASSERT_EQ_FMTm("hex", 0x2a, forty_two, "0x%x");
    PASS();
}

TEST asserts_in_range(void) {
    ASSERT_IN_RANGE(1.0, 1.05, 0.1);
    ASSERT_IN_RANGE(1.05, 1.0, 0.1);
    ASSERT_IN_RANGE(3.0, 3.0, 0.0);
    ASSERT_IN_RANGEm("float args", 2.5f, 2.5f, 0.0f);
    PASS();
}

TEST asserts_strings(void) {
    const char *abc = "abc";
    const char *null_str = NULL;
    ASSERT_STR_EQ("abc", abc);
    ASSERT_STR_EQm("same", "abc", abc);
    ASSERT_STR_EQ(null_str, null_str);
    ASSERT_STRN_EQ("abX", abc, 2);
    ASSERT_STRN_EQm("prefix", "abcdef", abc, 3);
    PASS();
}

TEST asserts_memory(void) {
    const unsigned char a[4] = {1, 2, 3, 4};
    unsigned char b[4];
    memcpy(b, a, sizeof b);
    ASSERT_MEM_EQ(a, b, sizeof a);
    ASSERT_MEM_EQm("copy", a, b, 4);
    ASSERT_MEM_EQ(a, NULL, 0);
    PASS();
}

static enum greatest_test_res helper_checks_positive(int n) {
    ASSERT_GT(n, 0);
    PASS();
}

TEST check_call_passes(void) {
    CHECK_CALL(helper_checks_positive(3));
    CHECK_CALL(helper_checks_positive(forty_two));
    PASSm("both helper calls passed");
}

TEST skipped_plain(void) { SKIP(); }

TEST skipped_with_message(void) { SKIPm("selftest skip message"); }

SUITE(assert_suite) {
    RUN_TEST(asserts_basic);
    RUN_TEST(asserts_compare);
    RUN_TEST(asserts_eq_fmt);
    RUN_TEST(asserts_in_range);
    RUN_TEST(asserts_strings);
    RUN_TEST(asserts_memory);
    RUN_TEST(check_call_passes);
    RUN_TEST(skipped_plain);
    RUN_TEST(skipped_with_message);
}

/* ---- setup / teardown and argument-taking tests ---- */

struct fixture { int setups, teardowns, value; };
static struct fixture fix;

static void fixture_setup(void *udata) {
    struct fixture *f = (struct fixture *)udata;
    f->setups++;
    f->value = 42;
}

static void fixture_teardown(void *udata) {
    struct fixture *f = (struct fixture *)udata;
    f->teardowns++;
    f->value = -1;
}

TEST fixture_is_fresh(void) {
    ASSERT_EQ_FMT(42, fix.value, "%d");
    ASSERT_EQ_FMT(fix.teardowns + 1, fix.setups, "%d");
    fix.value = 0;  /* the next test must see 42 again */
    PASS();
}

TEST takes_int(int n) {
    ASSERT_EQ_FMT(7, n, "%d");
    PASS();
}

TEST takes_two(int a, const char *s) {
    ASSERT_EQ(3, a);
    ASSERT_STR_EQ("three", s);
    PASS();
}

SUITE(runner_suite) {
    SET_SETUP(fixture_setup, &fix);
    SET_TEARDOWN(fixture_teardown, &fix);
    RUN_TEST(fixture_is_fresh);
    RUN_TEST(fixture_is_fresh);
    RUN_TEST1(takes_int, 7);
    RUN_TESTp(takes_two, 3, "three");
}

/* Runs outside any suite, after runner_suite. */
TEST fixture_cleared_after_suite(void) {
    ASSERT_EQ_FMT(fix.setups, fix.teardowns, "%d");
    ASSERT(greatest_info.setup == NULL);
    ASSERT(greatest_info.teardown == NULL);
    PASS();
}

/* ---- deliberately failing tests ---- */

TEST fail_assert(void) { ASSERT(one == 2); PASS(); }
TEST fail_assertm(void) { ASSERTm("selftest-ASSERTm", one == 2); PASS(); }
TEST fail_assert_false(void) { ASSERT_FALSEm("selftest-ASSERT_FALSEm", one == 1); PASS(); }
TEST fail_eq(void) { ASSERT_EQ(1, two); PASS(); }
TEST fail_eqm(void) { ASSERT_EQm("selftest-ASSERT_EQm", 1, two); PASS(); }
TEST fail_neq(void) { ASSERT_NEQm("selftest-ASSERT_NEQm", two, 2); PASS(); }
TEST fail_gt(void) { ASSERT_GTm("selftest-ASSERT_GTm", one, two); PASS(); }
TEST fail_gte(void) { ASSERT_GTEm("selftest-ASSERT_GTEm", one, two); PASS(); }
TEST fail_lt(void) { ASSERT_LTm("selftest-ASSERT_LTm", two, one); PASS(); }
TEST fail_lte(void) { ASSERT_LTEm("selftest-ASSERT_LTEm", two, one); PASS(); }
TEST fail_eq_fmt(void) {
    ASSERT_EQ_FMTm("selftest-ASSERT_EQ_FMTm", 41, forty_two, "%d");
    PASS();
}
TEST fail_in_range(void) {
    ASSERT_IN_RANGEm("selftest-ASSERT_IN_RANGEm", 1.0, 1.5, 0.25);
    PASS();
}
TEST fail_str_eq(void) { ASSERT_STR_EQm("selftest-ASSERT_STR_EQm", "abc", "abd"); PASS(); }
TEST fail_strn_eq(void) {
    ASSERT_STRN_EQm("selftest-ASSERT_STRN_EQm", "abcdef", "abXdef", 4);
    PASS();
}
TEST fail_mem_eq(void) {
    const unsigned char a[4] = {1, 2, 3, 4}, b[4] = {1, 2, 9, 4};
    ASSERT_MEM_EQm("selftest-ASSERT_MEM_EQm", a, b, sizeof a);
    PASS();
}
TEST fail_failm(void) { FAILm("selftest-FAILm"); }
TEST fail_plain(void) { FAIL(); }

static enum greatest_test_res helper_fails(void) { FAILm("selftest-CHECK_CALL"); }
TEST fail_check_call(void) { CHECK_CALL(helper_fails()); PASS(); }

/* What each failing test must report: message and a piece of the details. */
static const struct expected_failure {
    enum greatest_test_res (*test)(void);
    const char *name, *msg, *detail;
} expected_failures[] = {
    {fail_assert, "fail_assert", "one == 2", ""},
    {fail_assertm, "fail_assertm", "selftest-ASSERTm", ""},
    {fail_assert_false, "fail_assert_false", "selftest-ASSERT_FALSEm", ""},
    {fail_eq, "fail_eq", "1 != two", ""},
    {fail_eqm, "fail_eqm", "selftest-ASSERT_EQm", ""},
    {fail_neq, "fail_neq", "selftest-ASSERT_NEQm", ""},
    {fail_gt, "fail_gt", "selftest-ASSERT_GTm", ""},
    {fail_gte, "fail_gte", "selftest-ASSERT_GTEm", ""},
    {fail_lt, "fail_lt", "selftest-ASSERT_LTm", ""},
    {fail_lte, "fail_lte", "selftest-ASSERT_LTEm", ""},
    {fail_eq_fmt, "fail_eq_fmt", "selftest-ASSERT_EQ_FMTm",
     "  Expected: 41\n       Got: 42\n"},
    {fail_in_range, "fail_in_range", "selftest-ASSERT_IN_RANGEm",
     "  Expected: 1 +/- 0.25\n       Got: 1.5\n"},
    {fail_str_eq, "fail_str_eq", "selftest-ASSERT_STR_EQm",
     "  Expected: \"abc\"\n       Got: \"abd\"\n"},
    {fail_strn_eq, "fail_strn_eq", "selftest-ASSERT_STRN_EQm",
     "  Expected: \"abcd\"\n       Got: \"abXd\"\n"},
    {fail_mem_eq, "fail_mem_eq", "selftest-ASSERT_MEM_EQm",
     "First difference at offset 2 of 4\n  Expected: 03 04\n       Got: 09 04\n"},
    {fail_failm, "fail_failm", "selftest-FAILm", ""},
    {fail_check_call, "fail_check_call", "selftest-CHECK_CALL", ""},
};
#define N_EXPECTED_FAILURES (sizeof expected_failures / sizeof expected_failures[0])

static int fail_setups, fail_teardowns;
static void count_setup(void *udata) { (void)udata; fail_setups++; }
static void count_teardown(void *udata) { (void)udata; fail_teardowns++; }

SUITE(deliberate_failures) {
    SET_SETUP(count_setup, NULL);
    SET_TEARDOWN(count_teardown, NULL);
    RUN_TEST(fail_assert);
    RUN_TEST(fail_assertm);
    RUN_TEST(fail_assert_false);
    RUN_TEST(fail_eq);
    RUN_TEST(fail_eqm);
    RUN_TEST(fail_neq);
    RUN_TEST(fail_gt);
    RUN_TEST(fail_gte);
    RUN_TEST(fail_lt);
    RUN_TEST(fail_lte);
    RUN_TEST(fail_eq_fmt);
    RUN_TEST(fail_in_range);
    RUN_TEST(fail_str_eq);
    RUN_TEST(fail_strn_eq);
    RUN_TEST(fail_mem_eq);
    RUN_TEST(fail_failm);
    RUN_TEST(fail_plain);
    RUN_TEST(fail_check_call);
}

TEST teardown_ran_after_failures(void) {
    ASSERT_GT(fail_setups, 0);
    ASSERT_EQ_FMT(fail_setups, fail_teardowns, "%d");
    PASS();
}

/* Calls the failing tests directly (not through RUN_TEST) and checks that
 * each one returns FAIL early with the right message, line and details. */
TEST failures_are_detected(void) {
    size_t i;
    unsigned before = greatest_info.assertions;
    for (i = 0; i < N_EXPECTED_FAILURES; i++) {
        const struct expected_failure *e = &expected_failures[i];
        enum greatest_test_res res = e->test();
        ASSERT_EQm(e->name, GREATEST_TEST_RES_FAIL, res);
        ASSERTm(e->name, greatest_info.msg != NULL);
        ASSERT_STR_EQm(e->name, e->msg, greatest_info.msg);
        ASSERTm(e->name, greatest_info.fail_line > 0);
        ASSERTm(e->name, strstr(greatest_info.fail_file, "test_harness") != NULL);
        ASSERTm(e->name, strstr(greatest_info.detail, e->detail) != NULL);
    }
    ASSERT_EQ(GREATEST_TEST_RES_FAIL, fail_plain());
    ASSERT(greatest_info.msg == NULL);
    ASSERT_EQ(GREATEST_TEST_RES_SKIP, skipped_with_message());
    ASSERT_STR_EQ("selftest skip message", greatest_info.msg);
    ASSERT_EQ(GREATEST_TEST_RES_FAIL, helper_checks_positive(0));
    ASSERT_GTE(greatest_info.assertions, before + (unsigned)N_EXPECTED_FAILURES);
    PASS();
}

TEST nan_is_never_in_range(void) {
    double nan = strtod("nan", NULL);
    ASSERT_FALSE(greatest_in_range(nan, 1.0, 1e300));
    ASSERT_FALSE(greatest_in_range(1.0, nan, 1e300));
    PASS();
}

SUITE(meta_suite) {
    RUN_TEST(failures_are_detected);
    RUN_TEST(nan_is_never_in_range);
}

GREATEST_MAIN_DEFS();

int main(int argc, char **argv) {
    const char *want_fail = getenv("HARNESS_SELFTEST_FAIL");
    int run_failing = want_fail != NULL && want_fail[0] != '\0' &&
                      strcmp(want_fail, "0") != 0;
    GREATEST_MAIN_BEGIN();
    if (run_failing) {
        RUN_SUITE(deliberate_failures);
        RUN_TEST(teardown_ran_after_failures);
    }
    RUN_SUITE(assert_suite);
    RUN_SUITE(runner_suite);
    RUN_TEST(fixture_cleared_after_suite);
    RUN_SUITE(meta_suite);
    GREATEST_MAIN_END();
}
