# The command lines' tests (CTest label "cli"): every validation rule of the programs in apps/ and
# of the CLI11 bench drivers, run on the real binary with a bad option; each must stop before any
# model loads, with the documented exit status (apps/common/exit_codes.hpp) and a message naming
# the option. None needs the model: a file that exists stands in for --model where a rule after
# the model check is tested. Included from apps/CMakeLists.txt.
set(_cli_any_file ${CMAKE_CURRENT_SOURCE_DIR}/CMakeLists.txt)  # exists, is not a folder
set(_cli_missing /nonexistent/kvsift-cli-test)
set(_cli_scratch ${CMAKE_CURRENT_BINARY_DIR}/cli_test)
file(MAKE_DIRECTORY ${_cli_scratch})
file(WRITE ${_cli_scratch}/three_tokens.json "[1, 2, 3]\n")
file(WRITE ${_cli_scratch}/not_tokens.json "nope\n")

# cli_test(<name> <exit status> <output regex> <target> <args>...)
function(cli_test name status regex target)
  add_test(NAME cli.${name}
           COMMAND ${CMAKE_COMMAND} -DEXPECT_EXIT=${status} -DEXPECT_OUTPUT=${regex}
                   -P ${CMAKE_CURRENT_SOURCE_DIR}/cli_test.cmake
                   -- $<TARGET_FILE:${target}> ${ARGN})
  # KVSIFT_MODEL unset: the default model path is then one that does not exist here.
  set_tests_properties(cli.${name} PROPERTIES LABELS cli TIMEOUT 30
                       ENVIRONMENT "KVSIFT_MODEL=${_cli_missing}")
endfunction()

set(_cli_version "\\(kvsift [0-9]+\\.[0-9]+\\.[0-9]+")
set(_cli_exit_codes "Exit status: 0 done; 1 run-time failure; 2 usage error")

# kvsift-demo
cli_test(demo.version 0 "^kvsift-demo ${_cli_version}" kvsift-demo --version)
set(_cli_demo_choices "--selector TEXT:\\{dense,oracle,quest,locks.*=dense.*")
set(_cli_demo_devices "--device TEXT:\\{cpu,cuda,cuda:N\\}=cpu.*")
cli_test(demo.help 0 "${_cli_demo_choices}${_cli_demo_devices}${_cli_exit_codes}"
         kvsift-demo --help)
cli_test(demo.unknown_option 2 "--bogus" kvsift-demo --bogus)
cli_test(demo.top_p_zero 2 "--top-p: value 0 not in \\(0, 1\\]" kvsift-demo --top-p 0)
cli_test(demo.budget_negative 2 "--budget: value -1 not in \\(0, 1048576\\]"
         kvsift-demo --budget -1)
cli_test(demo.ctx_range 2 "--ctx: Value 9999999 not in range 1 to 1048576"
         kvsift-demo --ctx 9999999)
cli_test(demo.max_new_range 2 "--max-new: Value 0 not in range 1 to 8192" kvsift-demo --max-new 0)
cli_test(demo.selector_unknown 2 "--selector: bogus not in \\{dense,oracle"
         kvsift-demo --selector bogus)
cli_test(demo.device_name 2 "--device: 'gpu' is not cpu, cuda or cuda:N" kvsift-demo --device gpu)
cli_test(demo.budget_with_dense 2 "--budget: --selector dense attends every position and takes no"
         kvsift-demo --budget 0.1)
cli_test(demo.budget_beyond_ctx 2 "--budget 9000 tokens: more than --ctx 8192"
         kvsift-demo --selector locks --budget 9000)
cli_test(demo.epsilon_needs_locks_certified 2 "--epsilon: only --selector locks_certified reads it"
         kvsift-demo --selector quest --budget 0.1 --epsilon 0.01)
cli_test(demo.compression_needs_s4r 2 "--compression: only --selector s4r reads it"
         kvsift-demo --compression 4)
cli_test(demo.max_new_below_ctx 2 "--max-new 100: must be less than --ctx 64"
         kvsift-demo --ctx 64 --max-new 100)
cli_test(demo.sampling_needs_temperature 2 "--top-p and --seed sample: give --temperature > 0"
         kvsift-demo --seed 3)
cli_test(demo.model_missing 3 "--model ${_cli_missing}: No such file or directory" kvsift-demo)
cli_test(demo.model_is_folder 3 "--model /tmp: is a directory" kvsift-demo --model /tmp)
cli_test(demo.prompt_file_missing 3 "--prompt-file ${_cli_missing}: No such file or directory"
         kvsift-demo --model ${_cli_any_file} --prompt-file ${_cli_missing})
if(NOT KVSIFT_ENABLE_CUDA)
  cli_test(demo.device_without_cuda 2 "--device cuda: .*built without CUDA"
           kvsift-demo --device cuda)
endif()

# kvsift-eval
cli_test(eval.version 0 "^kvsift-eval ${_cli_version}" kvsift-eval --version)
cli_test(eval.help 0 "--suite TEXT:\\{smoke,default,full\\}=default.*${_cli_exit_codes}"
         kvsift-eval --help)
cli_test(eval.task_unknown 2 "--task-names: niah_bogus not in \\{niah_single_noise,niah_single_"
         kvsift-eval --task-names niah_bogus)
cli_test(eval.suite_unknown 2 "--suite: huge not in \\{smoke,default,full\\}"
         kvsift-eval --suite huge)
cli_test(eval.length_bad 2 "--lengths: '3X' is not a length" kvsift-eval --lengths 3X)
cli_test(eval.budget_zero 2 "--budgets: value 0 not in \\(0, 1048576\\]"
         kvsift-eval --budgets 0.1,0)
cli_test(eval.selector_unknown 2 "--selectors: bogus not in \\{dense,"
         kvsift-eval --selectors dense,bogus)
cli_test(eval.page_tokens 2 "--page-tokens: 48 not in \\{16,32,64\\}" kvsift-eval --page-tokens 48)
cli_test(eval.s4r_bases 2 "--s4r-bases: row not in \\{layer,head\\}" kvsift-eval --s4r-bases row)
cli_test(eval.model_missing 3 "--model ${_cli_missing}: No such file or directory" kvsift-eval)
cli_test(eval.tasks_missing 3 "--tasks ${_cli_missing}: No such file or directory"
         kvsift-eval --model ${_cli_any_file} --tasks ${_cli_missing})
cli_test(eval.tasks_with_lengths 2 "--tasks reads its samples from the file"
         kvsift-eval --tasks ${_cli_any_file} --lengths 1K)
cli_test(eval.dump_tasks_with_json 2 "--dump-tasks writes the samples and stops"
         kvsift-eval --dump-tasks ${_cli_scratch}/t.jsonl --json ${_cli_scratch}/j.json)
cli_test(eval.json_is_folder 4 "--json ${_cli_scratch}: is a folder"
         kvsift-eval --model ${_cli_any_file} --json ${_cli_scratch})
cli_test(eval.json_folder_missing 4 "--json ${_cli_missing}/x.json: no folder ${_cli_missing}"
         kvsift-eval --model ${_cli_any_file} --json ${_cli_missing}/x.json)
cli_test(eval.plots_is_file 4 "--plots ${_cli_any_file}: is a file, not a folder"
         kvsift-eval --model ${_cli_any_file} --plots ${_cli_any_file})
cli_test(eval.outputs_collide 4 "--json and --results name the same path"
         kvsift-eval --model ${_cli_any_file} --json ${_cli_scratch}/x.json
         --results ${_cli_scratch}/x.json)

# The CLI11 bench drivers (bench/)
if(KVSIFT_BUILD_BENCH)
  foreach(bench decode model offload)
    cli_test(bench_${bench}.version 0 "^kvsift-bench-${bench} ${_cli_version}"
             kvsift-bench-${bench} --version)
    cli_test(bench_${bench}.exit_codes_in_help 0 "${_cli_exit_codes}" kvsift-bench-${bench} --help)
  endforeach()
  cli_test(bench_decode.model_required 2 "--model is required" kvsift-bench-decode)
  cli_test(bench_decode.contexts_leave_no_prompt 2 "--contexts 30: leaves no prompt"
           kvsift-bench-decode --model ${_cli_any_file} --contexts 30)
  cli_test(bench_decode.selector_unknown 2 "--selectors: bogus not in \\{dense,"
           kvsift-bench-decode --model ${_cli_any_file} --selectors bogus)
  cli_test(bench_decode.budget_zero 2 "--budget: value 0 not in"
           kvsift-bench-decode --model ${_cli_any_file} --budget 0)
  cli_test(bench_decode.budgets_list_zero 2 "--budget: value 0 not in"
           kvsift-bench-decode --model ${_cli_any_file} --budgets 0.05,0)
  cli_test(bench_decode.contexts_list_leave_no_prompt 2 "--contexts 30: leaves no prompt"
           kvsift-bench-decode --model ${_cli_any_file} --contexts 1024,30)
  cli_test(bench_decode.fill_unknown 2 "--fill: disk not in \\{prompt,synthetic\\}"
           kvsift-bench-decode --model ${_cli_any_file} --fill disk)
  cli_test(bench_decode.kv_dtype_unknown 2 "--kv-dtype: q9 not in \\{bf16,f16"
           kvsift-bench-decode --model ${_cli_any_file} --kv-dtype q9)
  cli_test(bench_decode.weights_unknown 2 "--weights: q4 not in \\{bf16,f32,quantized\\}"
           kvsift-bench-decode --model ${_cli_any_file} --weights q4)
  cli_test(bench_decode.device_name 2 "--device: 'gpu' is not cpu, cuda or cuda:N"
           kvsift-bench-decode --model ${_cli_any_file} --device gpu)
  cli_test(bench_decode.select_on_device_without_device 2 "--select-on device: selection runs on"
           kvsift-bench-decode --model ${_cli_any_file} --select-on device)
  cli_test(bench_decode.select_on_unknown 2 "--select-on: gpu not in \\{cpu,device\\}"
           kvsift-bench-decode --model ${_cli_any_file} --select-on gpu)
  cli_test(bench_decode.model_missing 3 "--model ${_cli_missing}: No such file"
           kvsift-bench-decode --model ${_cli_missing})
  cli_test(bench_model.tokens_malformed 3 "--tokens .*not_tokens.json: not a JSON list"
           kvsift-bench-model --model ${_cli_any_file} --tokens ${_cli_scratch}/not_tokens.json)
  cli_test(bench_model.ctx_too_small 2 "--ctx 10: the 3 tokens and --n-decode steps need 67"
           kvsift-bench-model --model ${_cli_any_file} --tokens ${_cli_scratch}/three_tokens.json
           --ctx 10)
  cli_test(bench_model.mode_unknown 2 "--mode: both not in \\{prefill,decode\\}"
           kvsift-bench-model --model ${_cli_any_file} --tokens ${_cli_scratch}/three_tokens.json
           --mode both)
  cli_test(bench_offload.budget_range 2 "--budget: value 2 not in \\(0, 1\\]"
           kvsift-bench-offload --budget 2)
  cli_test(bench_offload.csv_is_folder 4 "--csv ${_cli_scratch}: is a folder"
           kvsift-bench-offload --csv ${_cli_scratch})
  cli_test(bench_offload.host_only_with_device 2 "--locks-device 0: --host-only uses no device"
           kvsift-bench-offload --host-only --locks-device 0)
endif()

# The provenance's hand-written SHA-256 (apps/common/sha256.hpp says why) on known vectors.
add_executable(kvsift_sha256_test common/sha256_test.cpp)
target_link_libraries(kvsift_sha256_test PRIVATE kvsift_apps_common)
add_test(NAME cli.sha256_vectors COMMAND kvsift_sha256_test)
set_tests_properties(cli.sha256_vectors PROPERTIES LABELS cli)
