# The evaluation's smoke test (CTest eval.smoke): a tiny suite through kvsift-eval with the real
# model, generated and then read back as a task file. Asserts that dense attention finds the
# single needle in noise at 1K in every sample (SmolLM2-135M does, at every depth), that the
# JSON has its provenance and every field of every record, and that the plots were drawn.
# Inputs: -DEVAL=<kvsift-eval> -DOUT=<scratch folder>. Skips without KVSIFT_MODEL.
if(NOT DEFINED ENV{KVSIFT_MODEL})
  message("kvsift-eval smoke test skipped: KVSIFT_MODEL is not set")
  return()
endif()
file(REMOVE_RECURSE "${OUT}")
file(MAKE_DIRECTORY "${OUT}")

function(run_eval)
  execute_process(COMMAND "${EVAL}" ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "kvsift-eval ${ARGN} failed (${rc}):\n${out}\n${err}")
  endif()
endfunction()

# Every record carries these; null is allowed only where a metric has no observation.
set(fields task length selector budget samples accuracy accuracy_vs_dense samples_below_dense
           samples_above_dense agreement mass_recall out_rel_err kv_bytes_per_step decode_tok_s)

# The provenance every JSON file opens with (apps/eval/report.hpp, RunInfo).
set(provenance_fields kvsift_version source model model_sha256 command cpu logical_cpus isa machine
                      date)

function(check_json file expected_configs)
  file(READ "${file}" document)
  foreach(f IN LISTS provenance_fields)
    string(JSON value ERROR_VARIABLE missing GET "${document}" provenance ${f})
    if(missing OR value STREQUAL "")
      message(FATAL_ERROR "${file}: the provenance has no ${f}")
    endif()
  endforeach()
  string(JSON sha GET "${document}" provenance model_sha256)
  file(SHA256 "$ENV{KVSIFT_MODEL}" expected_sha)
  if(NOT sha STREQUAL expected_sha)
    message(FATAL_ERROR "${file}: model_sha256 ${sha}, CMake's file(SHA256) ${expected_sha}")
  endif()
  string(JSON version GET "${document}" provenance kvsift_version)
  string(JSON isa GET "${document}" provenance isa)
  string(JSON date GET "${document}" provenance date)
  string(JSON command GET "${document}" provenance command)
  if(NOT version MATCHES "^[0-9]+\\.[0-9]+\\.[0-9]+"
     OR NOT isa MATCHES "^(scalar|avx2|avx512|avx512_vnni)$"
     OR NOT date MATCHES "^20[0-9][0-9]-[01][0-9]-[0-3][0-9]T[0-9:]+Z$"
     OR NOT command MATCHES "kvsift-eval")
    message(FATAL_ERROR "${file}: provenance version '${version}', isa '${isa}', date '${date}', "
                        "command '${command}'")
  endif()
  string(JSON json GET "${document}" records)
  string(JSON n LENGTH "${json}")
  if(NOT n EQUAL expected_configs)
    message(FATAL_ERROR "${file}: ${n} records, expected ${expected_configs}")
  endif()
  math(EXPR last "${n} - 1")
  foreach(i RANGE ${last})
    foreach(f IN LISTS fields)
      string(JSON type ERROR_VARIABLE missing TYPE "${json}" ${i} ${f})
      if(missing)
        message(FATAL_ERROR "${file}: record ${i} has no field ${f}")
      endif()
      if(type STREQUAL "NULL" AND NOT f STREQUAL "accuracy_vs_dense")
        message(FATAL_ERROR "${file}: record ${i} has ${f} = null")
      endif()
    endforeach()
    string(JSON selector GET "${json}" ${i} selector)
    string(JSON accuracy GET "${json}" ${i} accuracy)
    string(JSON recall GET "${json}" ${i} mass_recall)
    if(selector STREQUAL "dense" AND NOT accuracy EQUAL 1)
      message(FATAL_ERROR "${file}: dense accuracy on the 1K single needle is ${accuracy}, not 1")
    endif()
    if(recall GREATER 1.000001 OR recall LESS_EQUAL 0)
      message(FATAL_ERROR "${file}: record ${i} has mass_recall ${recall} outside (0, 1]")
    endif()
    # The paired counts: none for dense against itself, none below dense where every sample
    # scored (dense does here), never more than the samples.
    string(JSON samples GET "${json}" ${i} samples)
    string(JSON below GET "${json}" ${i} samples_below_dense)
    string(JSON above GET "${json}" ${i} samples_above_dense)
    math(EXPR paired "${below} + ${above}")
    if(paired GREATER samples OR (selector STREQUAL "dense" AND paired GREATER 0)
       OR (accuracy EQUAL 1 AND below GREATER 0))
      message(FATAL_ERROR "${file}: record ${i} (${selector}, ${samples} samples, accuracy "
                          "${accuracy}) has ${below} samples below dense and ${above} above")
    endif()
  endforeach()
endfunction()

run_eval(--suite smoke --json "${OUT}/generated.json" --plots "${OUT}/plots")
check_json("${OUT}/generated.json" 2)  # dense, oracle at 0.1
foreach(png accuracy mass_recall kv_bytes)
  if(NOT EXISTS "${OUT}/plots/${png}.png")
    message(FATAL_ERROR "kvsift-eval drew no ${png}.png")
  endif()
endforeach()

# The same samples through --tasks, the path reviewers' own task files take.
run_eval(--suite smoke --dump-tasks "${OUT}/tasks.jsonl")
run_eval(--tasks "${OUT}/tasks.jsonl" --selectors dense --json "${OUT}/from_file.json")
check_json("${OUT}/from_file.json" 1)
