#!/bin/sh
# Checks that the test harness (tests/greatest.h) passes, fails, filters
# and reports as documented, by running the tests/test_harness.c binary.
#
# Usage: tests/harness_selftest.sh [path/to/test_harness]   (default ./test_harness)
# Build first, e.g.:
#   cc -std=c99 -Wall -Wextra -Werror -pedantic -Itests tests/test_harness.c -o test_harness
set -u

BIN=${1:-./test_harness}
N_FAILING=18        # tests in the deliberate_failures suite
N_ASSERTS_TESTS=6   # passing tests whose names start with "asserts_"
TMP=${TMPDIR:-/tmp}/harness_selftest.$$
errors=0
trap 'rm -f "$TMP"' EXIT HUP INT TERM

if [ ! -x "$BIN" ]; then
    echo "harness_selftest: $BIN is not an executable" >&2
    exit 2
fi

fail() { echo "FAIL: $*"; errors=$((errors + 1)); }
ok() { echo "ok:   $*"; }

# run ARGS... / run_env VAR=VALUE ARGS...: stdout to $TMP, exit status in $rc.
run() { "$BIN" "$@" >"$TMP" 2>/dev/null </dev/null; rc=$?; }
run_env() { var=$1; shift; env "$var" "$BIN" "$@" >"$TMP" 2>/dev/null </dev/null; rc=$?; }
last() { tail -n 1 "$TMP"; }
has() { grep -F -e "$1" "$TMP" >/dev/null; }
expect_last() {  # ERE that the last line must match, description
    if last | grep -E -e "$1" >/dev/null; then ok "$2"; else fail "$2 (last line: '$(last)')"; fi
}
expect_rc() {  # zero|nonzero, description
    if { [ "$1" = zero ] && [ "$rc" -eq 0 ]; } || { [ "$1" = nonzero ] && [ "$rc" -ne 0 ]; }; then
        ok "$2 (exit $rc)"
    else
        fail "$2 (exit $rc)"
    fi
}
expect_has() { if has "$1"; then ok "$2"; else fail "$2: missing '$1'"; fi; }
expect_not() { if has "$1"; then fail "$2: unexpected '$1'"; else ok "$2"; fi; }

# (a) normal run passes
run_env HARNESS_SELFTEST_FAIL=0
expect_rc zero "normal run"
expect_last '^[0-9]+ passed, 0 failed(, [0-9]+ skipped)?$' "normal run summary"
total_passed=$(last | sed 's/ passed.*//')

# (b) deliberate failures are reported and make the run fail
run_env HARNESS_SELFTEST_FAIL=1
expect_rc nonzero "failing run"
expect_last "^[0-9]+ passed, $N_FAILING failed(, [0-9]+ skipped)?\$" "failing run summary"
for msg in 'fail_assert: one == 2' selftest-ASSERTm selftest-ASSERT_FALSEm \
        'fail_eq: 1 != two' selftest-ASSERT_EQm selftest-ASSERT_NEQm \
        selftest-ASSERT_GTm selftest-ASSERT_GTEm selftest-ASSERT_LTm \
        selftest-ASSERT_LTEm selftest-ASSERT_EQ_FMTm selftest-ASSERT_IN_RANGEm \
        selftest-ASSERT_STR_EQm selftest-ASSERT_STRN_EQm selftest-ASSERT_MEM_EQm \
        selftest-FAILm 'FAIL fail_plain (' selftest-CHECK_CALL \
        'Expected: 41' 'Got: 42' 'Expected: 1 +/- 0.25' 'Got: 1.5' \
        'Expected: "abc"' 'Got: "abd"' 'First difference at offset 2 of 4' \
        'test_harness.c:'; do
    expect_has "$msg" "failure output has '$msg'"
done
expect_not 'FAIL teardown_ran_after_failures' "teardown runs after failing tests"

# (c) flags
run -h
expect_rc zero "-h"
expect_has "Usage:" "-h prints usage"

run -q
expect_rc nonzero "unknown flag is rejected"

run -l
expect_rc zero "-l"
expect_has "* Suite assert_suite:" "-l lists suites"
expect_has "  asserts_basic" "-l lists tests"
expect_has "fixture_cleared_after_suite" "-l lists tests outside suites"
expect_not " passed, " "-l runs nothing"

run -v -t asserts_
expect_rc zero "-t"
expect_last "^$N_ASSERTS_TESTS passed, 0 failed\$" "-t runs only matching tests"
expect_not "PASS fixture_is_fresh" "-t skips non-matching tests"

run -vtasserts_basic
expect_last '^1 passed, 0 failed$' "-t with attached value"

run -e -t asserts_basic
expect_last '^1 passed, 0 failed$' "-e -t exact match"
run -e -t asserts
expect_last '^0 passed, 0 failed$' "-e -t needs the whole name"

run -v -x asserts_
expect_rc zero "-x"
expect_not "PASS asserts_" "-x excludes matching tests"
expect_has "PASS takes_int" "-x keeps other tests"
expect_last "^$((total_passed - N_ASSERTS_TESTS)) passed, 0 failed" "-x summary"

run -v -x asserts_ -x takes_int
expect_not "PASS asserts_" "-x given twice: the first name excluded"
expect_not "PASS takes_int" "-x given twice: the second name excluded"

run -v -s runner
expect_has "* Suite runner_suite:" "-s runs the matching suite"
expect_not "* Suite assert_suite:" "-s skips other suites"
run -e -s runner
expect_not "* Suite runner_suite:" "-e -s needs the whole name"

run_env HARNESS_SELFTEST_FAIL=1 -f
expect_rc nonzero "-f"
expect_last '^0 passed, 1 failed$' "-f stops at the first failure"
expect_not selftest-ASSERTm "-f runs nothing after the failure"

run_env HARNESS_SELFTEST_FAIL=1 -v -f -t fail_eq_fmt
expect_last '^0 passed, 1 failed$' "-f with -t"

# GREATEST_TIMES: one line per test run, PROGRAM<tab>SUITE.TEST<tab>SECONDS
TIMES=${TMPDIR:-/tmp}/harness_selftest_times.$$
rm -f "$TIMES"
run_env GREATEST_TIMES="$TIMES" -e -t asserts_basic
if [ -f "$TIMES" ] && [ "$(wc -l < "$TIMES")" -eq 1 ] &&
    grep -E "$(printf '^[^\t]+\t[a-z_]+\.asserts_basic\t[0-9]+\.[0-9]{3}$')" "$TIMES" >/dev/null; then
    ok "GREATEST_TIMES records each test's wall time"
else
    fail "GREATEST_TIMES: '$(cat "$TIMES" 2>/dev/null)'"
fi
rm -f "$TIMES"

if [ "$errors" -ne 0 ]; then
    echo "harness_selftest: $errors check(s) failed"
    exit 1
fi
echo "harness_selftest: all checks passed"
