#!/bin/sh
# header_toc.sh - the table of contents at the top of pqcache.h matches the section
# banners of the implementation: the same numbers and titles, in the same order, each
# banner opening its section ("/* ---..." or "/* ===..." then "   N. Title"); and the
# implementation reads top-down: outside section 1 (Base) no function is declared ahead
# of its definition, so that no section calls one further down.
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
# forward declarations: a "static ... pqc__name(...);" statement (one or more lines) in
# section 2 or later whose name is defined ("static ... pqc__name(...)" then "{") below
fwd=$(awk '
    prev ~ /^\/\* [-=][-=][-=][-=][-=][-=][-=][-=][-=][-=][-=][-=]/ && match($0, /^   [0-9]+\. /) {
        sec = $1; sub(/\.$/, "", sec) }
    { prev = $0 }
    stmt == "" && /^static [^=]*pqc__[A-Za-z0-9_]+\(/ { stmt = $0; first = NR; ssec = sec + 0 }
    stmt != "" && NR > first { stmt = stmt " " $0 }
    stmt != "" && (/\) *;/ || /\{ *$/ || /^\{/ || /\{.*\} *$/) {
        name = stmt; sub(/\(.*/, "", name); sub(/.*[ *]/, "", name)
        if (stmt ~ /\) *;/ && stmt !~ /\{/) { if (!(name in decl) && ssec > 1) { decl[name] = first; dsec[name] = ssec } }
        else if (name in decl && !(name in defn)) defn[name] = NR
        stmt = "" }
    END { for (n in decl) if (n in defn) printf "    %s declared at line %d (section %d), defined at line %d\n", n, decl[n], dsec[n], defn[n] }
' "$hdr")
if [ -n "$fwd" ]; then
    echo "header_toc: functions declared ahead of their definition outside section 1:"
    echo "$fwd"
    fail=$((fail + 1))
else
    pass=$((pass + 1))
    echo "header_toc: no function declared ahead of its definition outside section 1"
fi
echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
