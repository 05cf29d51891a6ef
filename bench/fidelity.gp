# fidelity.gp - draws the attention mass that PQ selection keeps against its bytes per token,
# from the summary bench_fidelity writes (means over the four data sets of each level).
# Left: the search path (pqc_pq_search) against exact top-k; right: the cache path
# (pqc_cache_select) against the cache-shaped oracle. Colour: difficulty level; solid
# lines and filled circles: plain PQ; dashed lines and filled squares: the score-aware
# metric (q-metric, the default); open triangles: the metric from unrelated observation
# queries (q-unrel); crosses: the same after the drift rebuild (q-drift); open squares:
# sub-spaces of rope bands, Euclidean (bands); diamonds: rope bands with the metric, the
# RoPE layout stated (q-bands); filled down triangles: q-metric with the PQ top 2k re-ranked
# by exact keys (q-rerank2); stars: q-metric with an exact list of the worst-served tokens
# (q-outl); filled up triangles: both (q-rr2+outl); open circles: q-metric with
# residual-aware scoring (q-resid). The settings are
# labelled on the hard level.
#
# usage, from the repository root:
#   gnuplot bench/fidelity.gp                      (build/fidelity.dat -> build/fidelity.png)
#   gnuplot -e "dat='build/x.dat'; png='build/x.png'" bench/fidelity.gp
if (!exists("dat")) dat = 'build/fidelity.dat'
if (!exists("png")) png = 'build/fidelity.png'

if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {
    set terminal pngcairo size 1300,820 font 'sans,10' noenhanced
} else {
    set terminal png size 1300,820 noenhanced
}
set output png

levels = 'easy medium hard'
colors = '#1b9e77 #d95f02 #7570b3'
paths = 'search cache'
refs = 'exact top-k|cache-shaped oracle'

set multiplot layout 1,2 title 'PQ selection on hard LLM-like keys: attention mass kept vs bytes per token and KV head'
set logscale x 2
set xrange [2:32]
set xtics (2, 4, 8, 16, 32)
set yrange [0:1.08]
set ytics 0.1
set grid
set key outside below maxrows 10 font ',8' spacing 0.9
set xlabel 'bytes per token per KV head (codes + centroids)'
set arrow 1 from graph 0, first 1 to graph 1, first 1 nohead dashtype 2 lc rgb '#888888'

do for [p=0:1] {
    ref = p == 0 ? 'exact top-k' : 'cache-shaped oracle'
    set title sprintf('%s path: mass of the selection / mass of %s', word(paths, p + 1), ref)
    set ylabel sprintf('mass recall vs %s', ref)
    plot for [l=0:2] dat index (p*30 + l*10) using 1:4 with linespoints dt 1 pt 7 ps 1.2 \
             lc rgb word(colors, l + 1) title word(levels, l + 1).' plain', \
         for [l=0:2] dat index (p*30 + l*10 + 1) using 1:4 with linespoints dt 2 pt 5 ps 1.2 \
             lc rgb word(colors, l + 1) title word(levels, l + 1).' q-metric', \
         for [l=0:2] dat index (p*30 + l*10 + 2) using 1:4 with points pt 8 ps 1.5 \
             lc rgb word(colors, l + 1) title word(levels, l + 1).' q-unrel', \
         for [l=0:2] dat index (p*30 + l*10 + 3) using 1:4 with points pt 2 ps 1.5 \
             lc rgb word(colors, l + 1) title word(levels, l + 1).' q-drift', \
         for [l=0:2] dat index (p*30 + l*10 + 4) using 1:4 with points pt 4 ps 1.5 \
             lc rgb word(colors, l + 1) title word(levels, l + 1).' bands', \
         for [l=0:2] dat index (p*30 + l*10 + 5) using 1:4 with points pt 13 ps 1.5 \
             lc rgb word(colors, l + 1) title word(levels, l + 1).' q-bands', \
         for [l=0:2] dat index (p*30 + l*10 + 6) using 1:4 with points pt 11 ps 1.5 \
             lc rgb word(colors, l + 1) title word(levels, l + 1).' q-rerank2', \
         for [l=0:2] dat index (p*30 + l*10 + 7) using 1:4 with points pt 3 ps 1.5 \
             lc rgb word(colors, l + 1) title word(levels, l + 1).' q-outl', \
         for [l=0:2] dat index (p*30 + l*10 + 8) using 1:4 with points pt 9 ps 1.5 \
             lc rgb word(colors, l + 1) title word(levels, l + 1).' q-rr2+outl', \
         for [l=0:2] dat index (p*30 + l*10 + 9) using 1:4 with points pt 6 ps 1.5 \
             lc rgb word(colors, l + 1) title word(levels, l + 1).' q-resid', \
         dat index (p*30 + 20) using 1:4:(word(stringcolumn(8), 1)) with labels offset 0,-1.1 font ',8' notitle
}
unset multiplot
