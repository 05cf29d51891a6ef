#!/bin/sh
# run_all.sh - runs every test group through make, keeps a log of each under build/logs,
# and ends with one line adding up the groups' "N passed, N failed" lines.
# usage: tests/run_all.sh GROUP...   (make targets, e.g. test-core test-asan)
set -u
mkdir -p build/logs
pass=0
fail=0
skip=0
bad=""
for g in "$@"; do
    log=build/logs/$g.log
    echo "=== $g"
    if make --no-print-directory "$g" > "$log" 2>&1; then st=0; else st=1; fi
    grep -E '^[0-9]+ passed, [0-9]+ failed|^(FAIL|SKIP)|all checks passed|compile check|up to date|ERROR|error:' "$log" | sed 's/^/    /'
    counts=$(grep -E '^[0-9]+ passed, [0-9]+ failed(, [0-9]+ skipped)?$' "$log" |
        awk -F'[ ,]+' '{p += $1; f += $3; if (NF >= 5) s += $5} END {printf "%d %d %d", p, f, s}')
    set -- $counts "$@"
    pass=$((pass + $1)); fail=$((fail + $2)); skip=$((skip + $3))
    shift 3
    if [ "$st" != 0 ]; then
        bad="$bad $g"
        tail -n 30 "$log" | sed 's/^/    | /'
    fi
done
if [ -n "$bad" ]; then
    echo "failed groups:$bad (logs in build/logs)"
    [ "$fail" -gt 0 ] || fail=1
fi
if [ "$skip" -gt 0 ]; then
    echo "$pass passed, $fail failed, $skip skipped"
else
    echo "$pass passed, $fail failed"
fi
[ -z "$bad" ]
