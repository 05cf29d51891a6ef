#!/bin/sh
# run_all.sh - `make test`: builds the programs of every test group and runs the groups,
# TEST_JOBS at a time (default: the number of processors), in one parallel make, so
# that builds and groups overlap and every core works from the first second.
#
# Each group's output is in build/logs/GROUP.log and its summary is printed when it ends
# (tests/run_group.sh); compiler output is in build/logs/build.log. At the end: each
# group's wall time, the slowest tests (build/logs/slowest.txt keeps the 40 slowest:
# greatest's per-test times, pytest's durations, each fuzz target's run), the total wall
# time, and one line adding up the groups' "N passed, N failed" lines.
# usage: tests/run_all.sh GROUP...   (make targets, e.g. test-core test-asan; the Makefile
#        names them longest first, so that the long ones start first)
set -u
mk=${MAKE:-make}
jobs=${TEST_JOBS:-$(nproc 2>/dev/null || echo 2)}
L=build/logs
mkdir -p $L
for g in "$@"; do rm -f "$L/$g.status" "$L/$g.summary"; done
rm -f $L/times.tsv $L/slowest.txt
GREATEST_TIMES=$(pwd)/$L/times.tsv
export GREATEST_TIMES

now() { date +%s.%N 2>/dev/null | sed 's/N$/0/'; }
t0=$(now)
echo "make test: $# groups, $jobs at a time (TEST_JOBS); logs in $L"
targets=""
for g in "$@"; do targets="$targets run-$g"; done
# -s: no command lines (compiler messages go to build.log); -k: a group whose programs
# fail to build does not stop the others
# shellcheck disable=SC2086
$mk -s -k -j"$jobs" --no-print-directory $targets 2> $L/build.log
t1=$(now)

pass=0
fail=0
skip=0
bad=""
for g in "$@"; do
    if [ ! -f "$L/$g.status" ]; then
        bad="$bad $g"
        echo "=== $g: its programs did not build (build/logs/build.log):"
        grep -E 'error|Error' $L/build.log | head -n 20 | sed 's/^/    | /'
        continue
    fi
    st=$(cut -f2 "$L/$g.status")
    counts=$(grep -E '^[0-9]+ passed, [0-9]+ failed(, [0-9]+ skipped)?$' "$L/$g.log" |
        awk -F'[ ,]+' '{p += $1; f += $3; if (NF >= 5) s += $5} END {printf "%d %d %d", p, f, s}')
    # shellcheck disable=SC2086
    set -- $counts "$@"
    pass=$((pass + $1)); fail=$((fail + $2)); skip=$((skip + $3))
    shift 3
    [ "$st" = 0 ] || bad="$bad $g"
done

echo "--- wall time of each group (s), longest first:"
cat $L/*.status 2>/dev/null | sort -t"$(printf '\t')" -k3 -rn | awk -F'\t' '{printf "    %-20s %7.1f%s\n", $1, $3, $2 == 0 ? "" : "  FAILED"}'

# the slowest tests: greatest's lines, pytest's "--durations" lines, the fuzz targets' runs
{
    [ -f $L/times.tsv ] && awk -F'\t' '{ n = split($1, p, "/"); printf "%.3f\t%s: %s\n", $3, p[n], $2 }' $L/times.tsv
    for f in $L/*.log; do
        grp=$(basename "$f" .log)
        sed -n 's/^\([0-9][0-9.]*\)s call  *\(.*\)$/\1\t'"$grp"': \2/p' "$f"
        sed -n 's/^\(fuzz_[a-z_]*\): Done [0-9]* runs in \([0-9]*\) second.*/\2\t'"$grp"': \1/p' "$f"
    done
} 2>/dev/null | sort -t"$(printf '\t')" -k1 -rn | head -n 40 > $L/slowest.txt
echo "--- the slowest tests (s; all 40 in $L/slowest.txt):"
head -n 10 $L/slowest.txt | awk -F'\t' '{printf "    %7.2f  %s\n", $1, $2}'
awk -v a="$t0" -v b="$t1" 'BEGIN { printf "--- make test: %.0f s wall time\n", b - a }'

if [ -n "$bad" ]; then
    echo "failed groups:$bad (logs in $L)"
    [ "$fail" -gt 0 ] || fail=1
fi
if [ "$skip" -gt 0 ]; then
    echo "$pass passed, $fail failed, $skip skipped"
else
    echo "$pass passed, $fail failed"
fi
[ -z "$bad" ]
