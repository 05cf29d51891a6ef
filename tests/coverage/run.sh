#!/bin/sh
# run.sh - `make coverage`: line and branch coverage of pqcache.h and examples/tiny_llama
# by `make test`. The working tree's files (tracked, and untracked ones git does not
# ignore) are copied to build/coverage/tree, where `make test` runs with
# CFLAGS="-O1 -g --coverage": every program built with CFLAGS (the library's tests and
# the example's, the Python binding, the CUDA tier on the stand-in driver, MPI) records
# what it ran. The sanitizer and clang builds do not take CFLAGS and record nothing; the
# fuzz targets' inputs (the seed corpora and what the bounded runs kept) are replayed
# through the same entry points built with gcc --coverage. gcov's data of every program
# is merged by tests/coverage/merge.py into build/coverage/summary.txt and lines.txt.
#
# usage: tests/coverage/run.sh   (COVERAGE_GROUPS=... runs only those groups;
#        COVERAGE_SIZE=small runs every program on the small scenarios of tests/test_size.h,
#        which shows what the sanitizer runs of make test reach)
# Compare two runs: python3 tests/coverage/merge.py --compare OLD/lines.txt NEW/lines.txt
set -u
root=$(pwd)
out=$root/build/coverage
tree=$out/tree
PY=${PYTHON:-python3}
rm -rf "$tree" "$out/json"
mkdir -p "$tree" "$out/json"
if git rev-parse --git-dir >/dev/null 2>&1; then
    git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C "$tree"
else
    tar --exclude=./build -cf - . | tar -xf - -C "$tree"
fi
cd "$tree" || exit 1
flags="-O1 -g --coverage"
if [ -n "${COVERAGE_SIZE:-}" ]; then PQC_TEST_SIZE=$COVERAGE_SIZE; export PQC_TEST_SIZE; fi
st=0
if [ -n "${COVERAGE_GROUPS:-}" ]; then
    make --no-print-directory test CFLAGS="$flags" TEST_GROUPS="$COVERAGE_GROUPS" || st=1
else
    make --no-print-directory test CFLAGS="$flags" || st=1
fi
echo "=== fuzz inputs replayed under gcc --coverage"
for src in tests/fuzz/fuzz_*.c; do
    name=$(basename "$src" .c)
    name=${name#fuzz_}
    gcc -std=c99 $flags -Iexamples/tiny_llama -Itests "$src" tests/coverage/replay.c \
        -o "build/cov_replay_$name" -lm -lpthread || { st=1; continue; }
    printf '%s: ' "fuzz_$name"
    "build/cov_replay_$name" "tests/fuzz/corpus/$name" "build/fuzz_test_corpus/$name" 2>/dev/null | tail -n 1
done
echo "=== gcov"
find build -name '*.gcda' | while read -r f; do
    (cd "$out/json" && gcov --json-format --branch-probabilities -o "$tree/$(dirname "$f")" "$tree/$f" >/dev/null 2>&1)
done
cd "$root" || exit 1
$PY tests/coverage/merge.py "$tree" "$out" "$out"/json/*.json.gz || st=1
exit $st
