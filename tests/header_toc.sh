#!/bin/sh
# header_toc.sh - the table of contents at the top of pqcache.h matches the section
# banners of the implementation: the same numbers and titles, in the same order, each
# banner opening its section ("/* ---..." or "/* ===..." then "   N. Title").
# usage: tests/header_toc.sh [pqcache.h]
set -u
hdr=${1:-pqcache.h}
toc=$(mktemp "${TMPDIR:-/tmp}/toc.XXXXXX")
ban=$(mktemp "${TMPDIR:-/tmp}/ban.XXXXXX")
trap 'rm -f "$toc" "$ban"' EXIT HUP INT TERM
# the contents: "   N. Title   description" lines after the CONTENTS heading, up to a blank line
awk '/CONTENTS OF THE IMPLEMENTATION/ {on = 1; next}
     on && /^ *$/ {exit}
     on && match($0, /^ +[0-9]+\. /) {
         line = substr($0, RLENGTH + 1); n = $1; sub(/\.$/, "", n)
         sub(/  .*/, "", line); print n " " line }' "$hdr" > "$toc"
# the banners: a rule line, then "   N. Title"
awk 'prev ~ /^\/\* [-=][-=][-=][-=][-=][-=][-=][-=][-=][-=][-=][-=]/ && match($0, /^   [0-9]+\. /) {
         n = $1; sub(/\.$/, "", n); print n " " substr($0, RLENGTH + 1) }
     {prev = $0}' "$hdr" > "$ban"
pass=0
fail=0
if [ ! -s "$toc" ]; then
    echo "header_toc: no table of contents found in $hdr"
    fail=1
fi
i=0
while read -r n title; do
    i=$((i + 1))
    got=$(sed -n "${i}p" "$ban")
    case "$got" in
    "$n $title"*) pass=$((pass + 1)) ;;
    *) echo "header_toc: contents entry $n \"$title\" but banner $i is \"$got\""; fail=$((fail + 1)) ;;
    esac
done < "$toc"
extra=$(($(wc -l < "$ban") - i))
if [ "$extra" -gt 0 ]; then
    echo "header_toc: $extra banner(s) missing from the contents:"
    sed -n "$((i + 1)),\$p" "$ban" | sed 's/^/    /'
    fail=$((fail + 1))
fi
echo "header_toc: $pass sections in order"
echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
