# Written by kvsift-eval; run `gnuplot plots.gp` in this folder to redraw.
set terminal pngcairo size 1340,440 font 'sans,10' noenhanced
set grid
set key bottom right
set style data linespoints
$accuracy_2048_1 << EOD
0.05 0.833333
0.1 0.75
0.2 0.833333
EOD
$accuracy_2048_2 << EOD
0.05 0.833333
0.1 0.833333
0.2 0.833333
EOD
$accuracy_2048_3 << EOD
0.05 0.75
0.1 0.833333
0.2 0.833333
EOD
$accuracy_4096_1 << EOD
0.05 0.75
0.1 0.75
0.2 0.75
EOD
$accuracy_4096_2 << EOD
0.05 0.75
0.1 0.75
0.2 0.75
EOD
$accuracy_4096_3 << EOD
0.05 0.916667
0.1 0.75
0.2 0.75
EOD
$accuracy_8192_1 << EOD
0.05 1
0.1 1
0.2 1
EOD
$accuracy_8192_2 << EOD
0.05 1
0.1 1
0.2 1
EOD
$accuracy_8192_3 << EOD
0.05 1
0.1 1
0.2 1
EOD
set output 'accuracy.png'
set multiplot layout 1,3 title 'Task accuracy against budget (mean over the tasks dense can do)'
set logscale x
set xrange [0.0384615:0.26]
set xlabel 'budget (share of context tokens)'
set ylabel 'accuracy'
set yrange [0:1.05]
set xtics ('0.05' 0.05, '0.1' 0.1, '0.2' 0.2)
set title '2K context: 3 of 4 tasks'
plot $accuracy_2048_1 lc 1 pt 7 title 'oracle', $accuracy_2048_2 lc 2 pt 7 title 'locks', $accuracy_2048_3 lc 3 pt 7 title 'louver', 0.833333 with lines dt 2 lw 2 lc 'black' title 'dense'
set xtics ('0.05' 0.05, '0.1' 0.1, '0.2' 0.2)
set title '4K context: 3 of 4 tasks'
plot $accuracy_4096_1 lc 1 pt 7 title 'oracle', $accuracy_4096_2 lc 2 pt 7 title 'locks', $accuracy_4096_3 lc 3 pt 7 title 'louver', 0.833333 with lines dt 2 lw 2 lc 'black' title 'dense'
set xtics ('0.05' 0.05, '0.1' 0.1, '0.2' 0.2)
set title '8K context: 1 of 4 tasks'
plot $accuracy_8192_1 lc 1 pt 7 title 'oracle', $accuracy_8192_2 lc 2 pt 7 title 'locks', $accuracy_8192_3 lc 3 pt 7 title 'louver', 1 with lines dt 2 lw 2 lc 'black' title 'dense'
unset multiplot
unset logscale x
set autoscale xy
$mass_recall_2048_1 << EOD
0.05 0.766294
0.1 0.852233
0.2 0.915669
EOD
$mass_recall_2048_2 << EOD
0.05 0.755947
0.1 0.844172
0.2 0.914399
EOD
$mass_recall_2048_3 << EOD
0.05 0.880666
0.1 0.919922
0.2 0.95295
EOD
$mass_recall_4096_1 << EOD
0.05 0.833669
0.1 0.892569
0.2 0.939112
EOD
$mass_recall_4096_2 << EOD
0.05 0.826636
0.1 0.891232
0.2 0.939219
EOD
$mass_recall_4096_3 << EOD
0.05 0.911351
0.1 0.940757
0.2 0.966147
EOD
$mass_recall_8192_1 << EOD
0.05 0.926829
0.1 0.949403
0.2 0.970682
EOD
$mass_recall_8192_2 << EOD
0.05 0.926705
0.1 0.949074
0.2 0.970431
EOD
$mass_recall_8192_3 << EOD
0.05 0.940093
0.1 0.961665
0.2 0.979511
EOD
set output 'mass_recall.png'
set multiplot layout 1,3 title 'Attention-mass recall against budget (mean over the tasks whose selectors ran: steps, layers, heads)'
set logscale x
set xrange [0.0384615:0.26]
set xlabel 'budget (share of context tokens)'
set ylabel 'mass recall'
set yrange [0:1.05]
set xtics ('0.05' 0.05, '0.1' 0.1, '0.2' 0.2)
set title '2K context: 3 of 4 tasks'
plot $mass_recall_2048_1 lc 1 pt 7 title 'oracle', $mass_recall_2048_2 lc 2 pt 7 title 'locks', $mass_recall_2048_3 lc 3 pt 7 title 'louver', 1 with lines dt 2 lw 2 lc 'black' title 'dense'
set xtics ('0.05' 0.05, '0.1' 0.1, '0.2' 0.2)
set title '4K context: 3 of 4 tasks'
plot $mass_recall_4096_1 lc 1 pt 7 title 'oracle', $mass_recall_4096_2 lc 2 pt 7 title 'locks', $mass_recall_4096_3 lc 3 pt 7 title 'louver', 1 with lines dt 2 lw 2 lc 'black' title 'dense'
set xtics ('0.05' 0.05, '0.1' 0.1, '0.2' 0.2)
set title '8K context: 1 of 4 tasks'
plot $mass_recall_8192_1 lc 1 pt 7 title 'oracle', $mass_recall_8192_2 lc 2 pt 7 title 'locks', $mass_recall_8192_3 lc 3 pt 7 title 'louver', 1 with lines dt 2 lw 2 lc 'black' title 'dense'
unset multiplot
unset logscale x
set autoscale xy
$kv_dense << EOD
2048 43.8553
4096 89.3081
8192 179.279
EOD
$kv_1 << EOD
2048 1.9505
4096 4.05287
8192 8.63379
EOD
$kv_2 << EOD
2048 4.05987
4096 8.6312
8192 17.7744
EOD
$kv_3 << EOD
2048 8.44088
4096 17.4311
8192 35.7041
EOD
$kv_4 << EOD
2048 1.94257
4096 4.05287
8192 8.63379
EOD
$kv_5 << EOD
2048 4.05987
4096 8.62318
8192 17.7744
EOD
$kv_6 << EOD
2048 8.44088
4096 17.4519
8192 35.7041
EOD
$kv_7 << EOD
2048 2.16786
4096 4.43411
8192 7.06118
EOD
$kv_8 << EOD
2048 4.22005
4096 8.79514
8192 15.2612
EOD
$kv_9 << EOD
2048 8.43157
4096 17.5859
8192 32.6357
EOD
set terminal pngcairo size 1340,440 font 'sans,10' noenhanced
set output 'kv_bytes.png'
set multiplot layout 1,3 title 'K/V bytes read per decode step, all layers (mean over tasks and steps)'
set logscale xy 2
set xtics ('2K' 2048, '4K' 4096, '8K' 8192)
set xrange [1575.38:10649.6]
set xlabel 'context length (tokens)'
set ylabel 'MiB per step'
set key top left
set title 'oracle'
plot $kv_dense with linespoints dt 2 lc 'black' title 'dense', $kv_1 lc 1 dt 1 pt 6 title 'budget 0.05', $kv_2 lc 1 dt 2 pt 8 title 'budget 0.1', $kv_3 lc 1 dt 3 pt 10 title 'budget 0.2'
set title 'locks'
plot $kv_dense with linespoints dt 2 lc 'black' title 'dense', $kv_4 lc 2 dt 1 pt 4 title 'budget 0.05', $kv_5 lc 2 dt 2 pt 6 title 'budget 0.1', $kv_6 lc 2 dt 3 pt 8 title 'budget 0.2'
set title 'louver'
plot $kv_dense with linespoints dt 2 lc 'black' title 'dense', $kv_7 lc 3 dt 1 pt 10 title 'budget 0.05', $kv_8 lc 3 dt 2 pt 4 title 'budget 0.1', $kv_9 lc 3 dt 3 pt 6 title 'budget 0.2'
unset multiplot
