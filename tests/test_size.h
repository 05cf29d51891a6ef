/* test_size.h - how large the test scenarios are. PQC_TEST_SIZE=small (what `make test`
 * gives its sanitizer runs) picks, where a test has two sizes, the smallest scenario that
 * still reaches the code the full one reaches (`make coverage COVERAGE_SIZE=small` shows
 * what it reaches: the same lines; see docs/testing.md); anything else, and no
 * variable, the full-size scenario (the plain runs of `make test`, and every run of
 * `make test-long`). */
#ifndef PQC_TESTS_TEST_SIZE_H
#define PQC_TESTS_TEST_SIZE_H

#include <stdlib.h>
#include <string.h>

static int test_small(void)
{
    const char *e = getenv("PQC_TEST_SIZE");
    return e != NULL && strcmp(e, "small") == 0;
}

/* full in the full-size scenario, small in the small one */
#define TEST_SIZE(full, small) (test_small() ? (small) : (full))

#endif
