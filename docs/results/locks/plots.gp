# Written by kvsift-eval; run `gnuplot plots.gp` in this folder to redraw.
set terminal pngcairo size 1340,440 font 'sans,10' noenhanced
set grid
set key bottom right
set style data linespoints
$accuracy_2048_1 << EOD
0.01 0
0.02 0
0.05 0.765625
0.1 0.765625
0.2 0.78125
EOD
$accuracy_2048_2 << EOD
0.01 0
0.02 0
0.05 0.0625
0.1 0.203125
0.2 0.296875
EOD
$accuracy_2048_3 << EOD
0.01 0
0.02 0
0.05 0.765625
0.1 0.75
0.2 0.78125
EOD
$accuracy_2048_4 << EOD
0.01 0
0.02 0
0.05 0.78125
0.1 0.75
0.2 0.78125
EOD
$accuracy_4096_1 << EOD
0.01 0
0.02 0.916667
0.05 1
0.1 1
0.2 1
EOD
$accuracy_4096_2 << EOD
0.01 0
0.02 0
0.05 0.0833333
0.1 0.25
0.2 0.5
EOD
$accuracy_4096_3 << EOD
0.01 0
0.02 0.916667
0.05 0.916667
0.1 1
0.2 1
EOD
$accuracy_4096_4 << EOD
0.01 0
0.02 0.916667
0.05 0.916667
0.1 1
0.2 1
EOD
$accuracy_8192_1 << EOD
0.01 0.625
0.02 0.625
0.05 0.75
0.1 0.75
0.2 0.75
EOD
$accuracy_8192_2 << EOD
0.01 0
0.02 0
0.05 0
0.1 0.25
0.2 0.25
EOD
$accuracy_8192_3 << EOD
0.01 0.5
0.02 0.625
0.05 0.75
0.1 0.75
0.2 0.75
EOD
$accuracy_8192_4 << EOD
0.01 0.5
0.02 0.625
0.05 0.75
0.1 0.75
0.2 0.75
EOD
set output 'accuracy.png'
set multiplot layout 1,3 title 'Task accuracy against budget (mean over the tasks dense can do)'
set logscale x
set xrange [0.00769231:0.26]
set xlabel 'budget (share of context tokens)'
set ylabel 'accuracy'
set yrange [0:1.05]
set xtics ('0.01' 0.01, '0.02' 0.02, '0.05' 0.05, '0.1' 0.1, '0.2' 0.2)
set title '2K context: 4 of 4 tasks'
plot $accuracy_2048_1 lc 1 pt 7 title 'oracle', $accuracy_2048_2 lc 2 pt 7 title 'quest', $accuracy_2048_3 lc 3 pt 7 title 'locks', $accuracy_2048_4 lc 4 pt 7 title 'locks_certified', 0.78125 with lines dt 2 lw 2 lc 'black' title 'dense'
set xtics ('0.01' 0.01, '0.02' 0.02, '0.05' 0.05, '0.1' 0.1, '0.2' 0.2)
set title '4K context: 3 of 4 tasks'
plot $accuracy_4096_1 lc 1 pt 7 title 'oracle', $accuracy_4096_2 lc 2 pt 7 title 'quest', $accuracy_4096_3 lc 3 pt 7 title 'locks', $accuracy_4096_4 lc 4 pt 7 title 'locks_certified', 1 with lines dt 2 lw 2 lc 'black' title 'dense'
set xtics ('0.01' 0.01, '0.02' 0.02, '0.05' 0.05, '0.1' 0.1, '0.2' 0.2)
set title '8K context: 2 of 4 tasks'
plot $accuracy_8192_1 lc 1 pt 7 title 'oracle', $accuracy_8192_2 lc 2 pt 7 title 'quest', $accuracy_8192_3 lc 3 pt 7 title 'locks', $accuracy_8192_4 lc 4 pt 7 title 'locks_certified', 0.75 with lines dt 2 lw 2 lc 'black' title 'dense'
unset multiplot
unset logscale x
set autoscale xy
$mass_recall_2048_1 << EOD
0.01 0.468525
0.02 0.468525
0.05 0.757858
0.1 0.844614
0.2 0.912908
EOD
$mass_recall_2048_2 << EOD
0.01 0.468525
0.02 0.468525
0.05 0.69174
0.1 0.785966
0.2 0.869189
EOD
$mass_recall_2048_3 << EOD
0.01 0.468525
0.02 0.468525
0.05 0.748656
0.1 0.839726
0.2 0.911392
EOD
$mass_recall_2048_4 << EOD
0.01 0.468525
0.02 0.468525
0.05 0.748431
0.1 0.839765
0.2 0.911375
EOD
$mass_recall_4096_1 << EOD
0.01 0.484688
0.02 0.729915
0.05 0.827842
0.1 0.889201
0.2 0.936915
EOD
$mass_recall_4096_2 << EOD
0.01 0.484688
0.02 0.683177
0.05 0.777018
0.1 0.845029
0.2 0.903509
EOD
$mass_recall_4096_3 << EOD
0.01 0.484688
0.02 0.722479
0.05 0.821995
0.1 0.886575
0.2 0.935615
EOD
$mass_recall_4096_4 << EOD
0.01 0.484688
0.02 0.722383
0.05 0.822053
0.1 0.886609
0.2 0.935623
EOD
$mass_recall_8192_1 << EOD
0.01 0.773466
0.02 0.833358
0.05 0.894108
0.1 0.934441
0.2 0.96502
EOD
$mass_recall_8192_2 << EOD
0.01 0.748775
0.02 0.806241
0.05 0.865237
0.1 0.90378
0.2 0.943078
EOD
$mass_recall_8192_3 << EOD
0.01 0.783658
0.02 0.830412
0.05 0.893215
0.1 0.933216
0.2 0.964572
EOD
$mass_recall_8192_4 << EOD
0.01 0.783466
0.02 0.830371
0.05 0.892074
0.1 0.933921
0.2 0.964562
EOD
set output 'mass_recall.png'
set multiplot layout 1,3 title 'Attention-mass recall against budget (mean over the tasks whose selectors ran: steps, layers, heads)'
set logscale x
set xrange [0.00769231:0.26]
set xlabel 'budget (share of context tokens)'
set ylabel 'mass recall'
set yrange [0:1.05]
set xtics ('0.01' 0.01, '0.02' 0.02, '0.05' 0.05, '0.1' 0.1, '0.2' 0.2)
set title '2K context: 4 of 4 tasks'
plot $mass_recall_2048_1 lc 1 pt 7 title 'oracle', $mass_recall_2048_2 lc 2 pt 7 title 'quest', $mass_recall_2048_3 lc 3 pt 7 title 'locks', $mass_recall_2048_4 lc 4 pt 7 title 'locks_certified', 1 with lines dt 2 lw 2 lc 'black' title 'dense'
set xtics ('0.01' 0.01, '0.02' 0.02, '0.05' 0.05, '0.1' 0.1, '0.2' 0.2)
set title '4K context: 3 of 4 tasks'
plot $mass_recall_4096_1 lc 1 pt 7 title 'oracle', $mass_recall_4096_2 lc 2 pt 7 title 'quest', $mass_recall_4096_3 lc 3 pt 7 title 'locks', $mass_recall_4096_4 lc 4 pt 7 title 'locks_certified', 1 with lines dt 2 lw 2 lc 'black' title 'dense'
set xtics ('0.01' 0.01, '0.02' 0.02, '0.05' 0.05, '0.1' 0.1, '0.2' 0.2)
set title '8K context: 2 of 4 tasks'
plot $mass_recall_8192_1 lc 1 pt 7 title 'oracle', $mass_recall_8192_2 lc 2 pt 7 title 'quest', $mass_recall_8192_3 lc 3 pt 7 title 'locks', $mass_recall_8192_4 lc 4 pt 7 title 'locks_certified', 1 with lines dt 2 lw 2 lc 'black' title 'dense'
unset multiplot
unset logscale x
set autoscale xy
$kv_dense << EOD
2048 44.0818
4096 89.295
8192 179.185
EOD
$kv_1 << EOD
2048 0.544473
4096 0.54213
8192 1.57628
EOD
$kv_2 << EOD
2048 0.544473
4096 1.58326
8192 3.34009
EOD
$kv_3 << EOD
2048 1.94775
4096 4.04349
8192 8.60805
EOD
$kv_4 << EOD
2048 4.05602
4096 8.6138
8192 17.7542
EOD
$kv_5 << EOD
2048 8.50616
4096 17.4782
8192 35.6784
EOD
$kv_6 << EOD
2048 0.544473
4096 0.54213
8192 1.58173
EOD
$kv_7 << EOD
2048 0.544473
4096 1.59776
8192 3.34035
EOD
$kv_8 << EOD
2048 1.95101
4096 4.04598
8192 8.61671
EOD
$kv_9 << EOD
2048 4.05615
4096 8.61557
8192 17.7465
EOD
$kv_10 << EOD
2048 8.49873
4096 17.4839
8192 35.6812
EOD
$kv_11 << EOD
2048 0.544473
4096 0.54213
8192 1.58831
EOD
$kv_12 << EOD
2048 0.544473
4096 1.58902
8192 3.33461
EOD
$kv_13 << EOD
2048 1.94665
4096 4.04314
8192 8.61499
EOD
$kv_14 << EOD
2048 4.05602
4096 8.6138
8192 17.7542
EOD
$kv_15 << EOD
2048 8.50616
4096 17.4782
8192 35.6838
EOD
$kv_16 << EOD
2048 0.544473
4096 0.54213
8192 1.58831
EOD
$kv_17 << EOD
2048 0.544473
4096 1.58902
8192 3.33461
EOD
$kv_18 << EOD
2048 1.94665
4096 4.04314
8192 8.61353
EOD
$kv_19 << EOD
2048 4.05602
4096 8.6138
8192 17.7603
EOD
$kv_20 << EOD
2048 8.50616
4096 17.4782
8192 35.6838
EOD
set terminal pngcairo size 1760,440 font 'sans,10' noenhanced
set output 'kv_bytes.png'
set multiplot layout 1,4 title 'K/V bytes read per decode step, all layers (mean over tasks and steps)'
set logscale xy 2
set xtics ('2K' 2048, '4K' 4096, '8K' 8192)
set xrange [1575.38:10649.6]
set xlabel 'context length (tokens)'
set ylabel 'MiB per step'
set key top left
set title 'oracle'
plot $kv_dense with linespoints dt 2 lc 'black' title 'dense', $kv_1 lc 1 dt 1 pt 6 title 'budget 0.01', $kv_2 lc 1 dt 2 pt 8 title 'budget 0.02', $kv_3 lc 1 dt 3 pt 10 title 'budget 0.05', $kv_4 lc 1 dt 4 pt 4 title 'budget 0.1', $kv_5 lc 1 dt 1 pt 6 title 'budget 0.2'
set title 'quest'
plot $kv_dense with linespoints dt 2 lc 'black' title 'dense', $kv_6 lc 2 dt 1 pt 8 title 'budget 0.01', $kv_7 lc 2 dt 2 pt 10 title 'budget 0.02', $kv_8 lc 2 dt 3 pt 4 title 'budget 0.05', $kv_9 lc 2 dt 4 pt 6 title 'budget 0.1', $kv_10 lc 2 dt 1 pt 8 title 'budget 0.2'
set title 'locks'
plot $kv_dense with linespoints dt 2 lc 'black' title 'dense', $kv_11 lc 3 dt 1 pt 10 title 'budget 0.01', $kv_12 lc 3 dt 2 pt 4 title 'budget 0.02', $kv_13 lc 3 dt 3 pt 6 title 'budget 0.05', $kv_14 lc 3 dt 4 pt 8 title 'budget 0.1', $kv_15 lc 3 dt 1 pt 10 title 'budget 0.2'
set title 'locks_certified'
plot $kv_dense with linespoints dt 2 lc 'black' title 'dense', $kv_16 lc 4 dt 1 pt 4 title 'budget 0.01', $kv_17 lc 4 dt 2 pt 6 title 'budget 0.02', $kv_18 lc 4 dt 3 pt 8 title 'budget 0.05', $kv_19 lc 4 dt 4 pt 10 title 'budget 0.1', $kv_20 lc 4 dt 1 pt 4 title 'budget 0.2'
unset multiplot
