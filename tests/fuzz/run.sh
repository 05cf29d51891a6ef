#!/bin/sh
# run.sh - runs the libFuzzer targets for `make fuzz` and `make test-fuzz` (tests/fuzz/fuzz.mk).
#
# usage: tests/fuzz/run.sh time|test BUILD "LIBFUZZER OPTIONS" NAME:N...
#   time  NAME runs for N seconds on BUILD/fuzz_corpus/NAME, a scratch copy of the seed
#         corpus tests/fuzz/corpus/NAME that keeps what the runs add
#   test  every seed of NAME is replayed, then N inputs from -seed=1 (new inputs go to
#         BUILD/fuzz_test_corpus/NAME, emptied first)
# One line per target: its "Done N runs in S second(s)" line, or FAILED with the report's
# key lines; the full logs are in BUILD/fuzz_logs and reproducers in
# BUILD/fuzz_artifacts/NAME/. Last line: "N passed, N failed" (one test per target).
set -u
mode=$1
build=$2
opts=$3
shift 3
case $mode in time | test) ;; *) echo "run.sh: unknown mode '$mode'" >&2; exit 2 ;; esac
UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}
export UBSAN_OPTIONS
passed=0
failed=0
mkdir -p "$build/fuzz_logs"
for spec in "$@"; do
    name=${spec%%:*}
    n=${spec#*:}
    bin=$build/fuzz_$name
    seeds=tests/fuzz/corpus/$name
    log=$build/fuzz_logs/$name.$mode.log
    art=$build/fuzz_artifacts/$name/
    mkdir -p "$art"
    if [ "$mode" = time ]; then
        work=$build/fuzz_corpus/$name
        mkdir -p "$work"
        if [ -d "$seeds" ]; then
            for s in "$seeds"/*; do [ -f "$s" ] && cp "$s" "$work/"; done
        fi
        # shellcheck disable=SC2086
        "$bin" $opts -max_total_time="$n" -print_final_stats=1 -artifact_prefix="$art" "$work" > "$log" 2>&1
        st=$?
    else
        work=$build/fuzz_test_corpus/$name
        rm -rf "$work"
        mkdir -p "$work"
        if [ -d "$seeds" ]; then
            # shellcheck disable=SC2086
            "$bin" $opts -seed=1 -runs="$n" -print_final_stats=1 -artifact_prefix="$art" "$work" "$seeds" > "$log" 2>&1
        else
            # shellcheck disable=SC2086
            "$bin" $opts -seed=1 -runs="$n" -print_final_stats=1 -artifact_prefix="$art" "$work" > "$log" 2>&1
        fi
        st=$?
    fi
    done_line=$(grep -E '^Done [0-9]+ runs in [0-9]+ second' "$log" | tail -n 1)
    if [ "$st" = 0 ] && [ -n "$done_line" ]; then
        passed=$((passed + 1))
        echo "fuzz_$name: $done_line"
    else
        failed=$((failed + 1))
        echo "fuzz_$name: FAILED (exit status $st; log $log)"
        # the report's first lines and the top frames of its first stack, outside libFuzzer and libc
        awk '/FUZZ CHECK FAILED|==ERROR|ERROR: libFuzzer|runtime error|^ALARM|out-of-memory/ && !seen { print; seen = 1; next }
             seen == 1 && /^ *#[0-9]+ / { if ($0 !~ /fuzzer::|libc\.so|libc_start|sanitizer_print|_start |raise|abort|pthread_kill| in main / && n < 6) { print; n++ } next }
             seen == 1 && n > 0 && !/^ *#[0-9]+ / { seen = 2 }
             /^SUMMARY|Test unit written/ { print }' "$log" | sed 's/^/    /'
    fi
done
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
