# Written by kvsift-eval; run `gnuplot plots.gp` in this folder to redraw.
set terminal pngcairo size 920,440 font 'sans,10' noenhanced
set grid
set key bottom right
set style data linespoints
$accuracy_2048_1 << EOD
0.02 0
0.05 0.765625
EOD
$accuracy_2048_2 << EOD
0.02 0
0.05 0.0625
EOD
$accuracy_2048_3 << EOD
0.02 0
0.05 0.765625
EOD
$accuracy_4096_1 << EOD
0.02 0.916667
0.05 1
EOD
$accuracy_4096_2 << EOD
0.02 0
0.05 0.0833333
EOD
$accuracy_4096_3 << EOD
0.02 0.916667
0.05 0.916667
EOD
set output 'accuracy.png'
set multiplot layout 1,2 title 'Task accuracy against budget (mean over the tasks dense can do)'
set logscale x
set xrange [0.0153846:0.065]
set xlabel 'budget (share of context tokens)'
set ylabel 'accuracy'
set yrange [0:1.05]
set xtics ('0.02' 0.02, '0.05' 0.05)
set title '2K context: 4 of 4 tasks'
plot $accuracy_2048_1 lc 1 pt 7 title 'oracle', $accuracy_2048_2 lc 2 pt 7 title 'quest', $accuracy_2048_3 lc 3 pt 7 title 'locks', 0.78125 with lines dt 2 lw 2 lc 'black' title 'dense'
set xtics ('0.02' 0.02, '0.05' 0.05)
set title '4K context: 3 of 4 tasks'
plot $accuracy_4096_1 lc 1 pt 7 title 'oracle', $accuracy_4096_2 lc 2 pt 7 title 'quest', $accuracy_4096_3 lc 3 pt 7 title 'locks', 1 with lines dt 2 lw 2 lc 'black' title 'dense'
unset multiplot
unset logscale x
set autoscale xy
$mass_recall_2048_1 << EOD
0.02 0.468525
0.05 0.757858
EOD
$mass_recall_2048_2 << EOD
0.02 0.468525
0.05 0.69174
EOD
$mass_recall_2048_3 << EOD
0.02 0.468525
0.05 0.748656
EOD
$mass_recall_4096_1 << EOD
0.02 0.729915
0.05 0.827842
EOD
$mass_recall_4096_2 << EOD
0.02 0.683177
0.05 0.777018
EOD
$mass_recall_4096_3 << EOD
0.02 0.722479
0.05 0.821995
EOD
set output 'mass_recall.png'
set multiplot layout 1,2 title 'Attention-mass recall against budget (mean over the tasks whose selectors ran: steps, layers, heads)'
set logscale x
set xrange [0.0153846:0.065]
set xlabel 'budget (share of context tokens)'
set ylabel 'mass recall'
set yrange [0:1.05]
set xtics ('0.02' 0.02, '0.05' 0.05)
set title '2K context: 4 of 4 tasks'
plot $mass_recall_2048_1 lc 1 pt 7 title 'oracle', $mass_recall_2048_2 lc 2 pt 7 title 'quest', $mass_recall_2048_3 lc 3 pt 7 title 'locks', 1 with lines dt 2 lw 2 lc 'black' title 'dense'
set xtics ('0.02' 0.02, '0.05' 0.05)
set title '4K context: 3 of 4 tasks'
plot $mass_recall_4096_1 lc 1 pt 7 title 'oracle', $mass_recall_4096_2 lc 2 pt 7 title 'quest', $mass_recall_4096_3 lc 3 pt 7 title 'locks', 1 with lines dt 2 lw 2 lc 'black' title 'dense'
unset multiplot
unset logscale x
set autoscale xy
$kv_dense << EOD
2048 44.0818
4096 89.295
EOD
$kv_1 << EOD
2048 0.544473
4096 1.58326
EOD
$kv_2 << EOD
2048 1.94775
4096 4.04349
EOD
$kv_3 << EOD
2048 0.544473
4096 1.59776
EOD
$kv_4 << EOD
2048 1.95101
4096 4.04598
EOD
$kv_5 << EOD
2048 0.544473
4096 1.58902
EOD
$kv_6 << EOD
2048 1.94665
4096 4.04314
EOD
set terminal pngcairo size 1340,440 font 'sans,10' noenhanced
set output 'kv_bytes.png'
set multiplot layout 1,3 title 'K/V bytes read per decode step, all layers (mean over tasks and steps)'
set logscale xy 2
set xtics ('2K' 2048, '4K' 4096)
set xrange [1575.38:5324.8]
set xlabel 'context length (tokens)'
set ylabel 'MiB per step'
set key top left
set title 'oracle'
plot $kv_dense with linespoints dt 2 lc 'black' title 'dense', $kv_1 lc 1 dt 1 pt 6 title 'budget 0.02', $kv_2 lc 1 dt 2 pt 8 title 'budget 0.05'
set title 'quest'
plot $kv_dense with linespoints dt 2 lc 'black' title 'dense', $kv_3 lc 2 dt 1 pt 10 title 'budget 0.02', $kv_4 lc 2 dt 2 pt 4 title 'budget 0.05'
set title 'locks'
plot $kv_dense with linespoints dt 2 lc 'black' title 'dense', $kv_5 lc 3 dt 1 pt 6 title 'budget 0.02', $kv_6 lc 3 dt 2 pt 8 title 'budget 0.05'
unset multiplot
