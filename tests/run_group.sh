#!/bin/sh
# run_group.sh - runs one test group for tests/run_all.sh: `MAKE GROUP` with its output in
# build/logs/GROUP.log, then prints the group's summary (its "N passed, N failed" lines,
# failures and skips, and the log's tail when it failed) in one piece, so that groups
# finishing side by side do not mix their lines. Leaves build/logs/GROUP.status:
# "GROUP<tab>EXIT STATUS<tab>SECONDS". Exits 0 whatever the group did (run_all.sh reads
# the status), so that the other groups go on.
# usage: tests/run_group.sh GROUP MAKE
set -u
g=$1
mk=${2:-make}
log=build/logs/$g.log
sum=build/logs/$g.summary
mkdir -p build/logs
now() { date +%s.%N 2>/dev/null | sed 's/N$/0/'; }
t0=$(now)
if $mk --no-print-directory --no-silent "$g" > "$log" 2>&1; then st=0; else st=1; fi
t1=$(now)
secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
{
    echo "=== $g: $secs s$( [ "$st" = 0 ] || echo ', FAILED')"
    grep -E '^[0-9]+ passed, [0-9]+ failed|^(FAIL|SKIP)|all checks passed|compile check|ERROR|error:' "$log" | sed 's/^/    /'
    if [ "$st" != 0 ]; then tail -n 30 "$log" | sed 's/^/    | /'; fi
} > "$sum"
printf '%s\t%s\t%s\n' "$g" "$st" "$secs" > "build/logs/$g.status"
cat "$sum"
exit 0
