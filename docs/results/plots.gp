# Written by kvsift-eval; run `gnuplot plots.gp` in this folder to redraw.
set terminal pngcairo size 1340,440 font 'sans,10' noenhanced
set grid
set key bottom right
set style data linespoints
$accuracy_1024_1 << EOD
0.05 0.479167
0.2 0.75
EOD
$accuracy_1024_2 << EOD
0.05 0
0.2 0.4375
EOD
$accuracy_1024_3 << EOD
0.05 0.375
0.2 0.75
EOD
$accuracy_2048_1 << EOD
0.05 0.7
0.2 0.75
EOD
$accuracy_2048_2 << EOD
0.05 0.1
0.2 0.325
EOD
$accuracy_2048_3 << EOD
0.05 0.725
0.2 0.725
EOD
$accuracy_4096_1 << EOD
0.05 0.770833
0.2 0.75
EOD
$accuracy_4096_2 << EOD
0.05 0.104167
0.2 0.583333
EOD
$accuracy_4096_3 << EOD
0.05 0.770833
0.2 0.75
EOD
set output 'accuracy.png'
set multiplot layout 1,3 title 'Task accuracy against budget (mean over the tasks dense can do)'
set logscale x
set xrange [0.0384615:0.26]
set xlabel 'budget (share of context tokens)'
set ylabel 'accuracy'
set yrange [0:1.05]
set xtics ('0.05' 0.05, '0.2' 0.2)
set title '1K context: 6 of 7 tasks'
plot $accuracy_1024_1 lc 1 pt 7 title 'oracle', $accuracy_1024_2 lc 2 pt 7 title 'quest', $accuracy_1024_3 lc 3 pt 7 title 'locks', 0.854167 with lines dt 2 lw 2 lc 'black' title 'dense'
set xtics ('0.05' 0.05, '0.2' 0.2)
set title '2K context: 5 of 7 tasks'
plot $accuracy_2048_1 lc 1 pt 7 title 'oracle', $accuracy_2048_2 lc 2 pt 7 title 'quest', $accuracy_2048_3 lc 3 pt 7 title 'locks', 0.725 with lines dt 2 lw 2 lc 'black' title 'dense'
set xtics ('0.05' 0.05, '0.2' 0.2)
set title '4K context: 6 of 7 tasks'
plot $accuracy_4096_1 lc 1 pt 7 title 'oracle', $accuracy_4096_2 lc 2 pt 7 title 'quest', $accuracy_4096_3 lc 3 pt 7 title 'locks', 0.770833 with lines dt 2 lw 2 lc 'black' title 'dense'
unset multiplot
unset logscale x
set autoscale xy
$mass_recall_1024_1 << EOD
0.05 0.645209
0.2 0.890163
EOD
$mass_recall_1024_2 << EOD
0.05 0.565998
0.2 0.846414
EOD
$mass_recall_1024_3 << EOD
0.05 0.637573
0.2 0.887384
EOD
$mass_recall_2048_1 << EOD
0.05 0.759232
0.2 0.91456
EOD
$mass_recall_2048_2 << EOD
0.05 0.68668
0.2 0.86828
EOD
$mass_recall_2048_3 << EOD
0.05 0.746728
0.2 0.913345
EOD
$mass_recall_4096_1 << EOD
0.05 0.830591
0.2 0.939972
EOD
$mass_recall_4096_2 << EOD
0.05 0.773462
0.2 0.900818
EOD
$mass_recall_4096_3 << EOD
0.05 0.824462
0.2 0.938442
EOD
set output 'mass_recall.png'
set multiplot layout 1,3 title 'Attention-mass recall against budget (mean over the tasks whose selectors ran: steps, layers, heads)'
set logscale x
set xrange [0.0384615:0.26]
set xlabel 'budget (share of context tokens)'
set ylabel 'mass recall'
set yrange [0:1.05]
set xtics ('0.05' 0.05, '0.2' 0.2)
set title '1K context: 6 of 7 tasks'
plot $mass_recall_1024_1 lc 1 pt 7 title 'oracle', $mass_recall_1024_2 lc 2 pt 7 title 'quest', $mass_recall_1024_3 lc 3 pt 7 title 'locks', 1 with lines dt 2 lw 2 lc 'black' title 'dense'
set xtics ('0.05' 0.05, '0.2' 0.2)
set title '2K context: 5 of 7 tasks'
plot $mass_recall_2048_1 lc 1 pt 7 title 'oracle', $mass_recall_2048_2 lc 2 pt 7 title 'quest', $mass_recall_2048_3 lc 3 pt 7 title 'locks', 1 with lines dt 2 lw 2 lc 'black' title 'dense'
set xtics ('0.05' 0.05, '0.2' 0.2)
set title '4K context: 6 of 7 tasks'
plot $mass_recall_4096_1 lc 1 pt 7 title 'oracle', $mass_recall_4096_2 lc 2 pt 7 title 'quest', $mass_recall_4096_3 lc 3 pt 7 title 'locks', 1 with lines dt 2 lw 2 lc 'black' title 'dense'
unset multiplot
unset logscale x
set autoscale xy
$kv_dense << EOD
1024 21.826
2048 43.1773
4096 89.2735
EOD
$kv_1 << EOD
1024 0.888956
2048 1.88227
4096 4.05103
EOD
$kv_2 << EOD
1024 4.05292
2048 8.22104
4096 17.4883
EOD
$kv_3 << EOD
1024 0.889067
2048 1.873
4096 4.0553
EOD
$kv_4 << EOD
1024 4.05404
2048 8.22255
4096 17.4903
EOD
$kv_5 << EOD
1024 0.889149
2048 1.88131
4096 4.05103
EOD
$kv_6 << EOD
1024 4.05292
2048 8.23346
4096 17.4823
EOD
set terminal pngcairo size 1340,440 font 'sans,10' noenhanced
set output 'kv_bytes.png'
set multiplot layout 1,3 title 'K/V bytes read per decode step, all layers (mean over tasks and steps)'
set logscale xy 2
set xtics ('1K' 1024, '2K' 2048, '4K' 4096)
set xrange [787.692:5324.8]
set xlabel 'context length (tokens)'
set ylabel 'MiB per step'
set key top left
set title 'oracle'
plot $kv_dense with linespoints dt 2 lc 'black' title 'dense', $kv_1 lc 1 dt 1 pt 6 title 'budget 0.05', $kv_2 lc 1 dt 2 pt 8 title 'budget 0.2'
set title 'quest'
plot $kv_dense with linespoints dt 2 lc 'black' title 'dense', $kv_3 lc 2 dt 1 pt 10 title 'budget 0.05', $kv_4 lc 2 dt 2 pt 4 title 'budget 0.2'
set title 'locks'
plot $kv_dense with linespoints dt 2 lc 'black' title 'dense', $kv_5 lc 3 dt 1 pt 6 title 'budget 0.05', $kv_6 lc 3 dt 2 pt 8 title 'budget 0.2'
unset multiplot
