# Installs a kvsift build into a temporary prefix and builds programs against it the ways a user
# would: find_package (tests/consumer/CMakeLists.txt), pkg-config, and the C++ wrapper; each
# program checks attention against its own reference; the cache-only program must not need
# oneDNN, ICU or CUDA. Last, a host project that takes kvsift as a subdirectory is configured.
#   cmake -DKVSIFT_BUILD_DIR=<build> -DWORK_DIR=<scratch> -DLIBDIR=<lib> -DGENERATOR=<gen>
#         -DC_COMPILER=<cc> -P run.cmake
foreach(var KVSIFT_BUILD_DIR WORK_DIR LIBDIR GENERATOR C_COMPILER)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run.cmake needs -D${var}=...")
  endif()
endforeach()
set(source_dir ${CMAKE_CURRENT_LIST_DIR})
set(prefix ${WORK_DIR}/prefix)
file(REMOVE_RECURSE ${WORK_DIR})

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message(STATUS "$ ${ARGN}\n${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}")
  endif()
endfunction()

run(${CMAKE_COMMAND} --install ${KVSIFT_BUILD_DIR} --prefix ${prefix})

# find_package: the whole library and the core layer.
run(${CMAKE_COMMAND} -S ${source_dir} -B ${WORK_DIR}/cmake -G ${GENERATOR}
    -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_C_COMPILER=${C_COMPILER} -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} --build ${WORK_DIR}/cmake)
run(${WORK_DIR}/cmake/attend_check_kvsift)
run(${WORK_DIR}/cmake/attend_check_core)
run(${WORK_DIR}/cmake/attend_check_cpp)

# pkg-config, as a Makefile would use it; the program finds the library through LD_LIBRARY_PATH.
find_program(PKG_CONFIG pkg-config REQUIRED)
set(ENV{PKG_CONFIG_PATH} ${prefix}/${LIBDIR}/pkgconfig)
foreach(package kvsift kvsift-core)
  execute_process(COMMAND ${PKG_CONFIG} --cflags --libs ${package} RESULT_VARIABLE rc
                  OUTPUT_VARIABLE flags ERROR_VARIABLE err OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "pkg-config ${package}: ${err}")
  endif()
  separate_arguments(flags UNIX_COMMAND "${flags}")
  run(${C_COMPILER} ${source_dir}/attend_check.c ${flags} -lm
      -o ${WORK_DIR}/attend_check_pc_${package})
  run(${CMAKE_COMMAND} -E env LD_LIBRARY_PATH=${prefix}/${LIBDIR}
      ${WORK_DIR}/attend_check_pc_${package})
endforeach()

# The cache-only programs load nothing of oneDNN, ICU or CUDA.
foreach(program ${WORK_DIR}/cmake/attend_check_core ${WORK_DIR}/attend_check_pc_kvsift-core)
  execute_process(COMMAND ${CMAKE_COMMAND} -E env LD_LIBRARY_PATH=${prefix}/${LIBDIR} ldd ${program}
                  OUTPUT_VARIABLE libraries RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0 OR NOT libraries MATCHES "libkvsift_core\\.so\\.")
    message(FATAL_ERROR "ldd ${program} (${rc}) does not list libkvsift_core:\n${libraries}")
  endif()
  if(libraries MATCHES "(libdnnl|libicu|libcuda|libcublas)[^\n]*")
    message(FATAL_ERROR "${program} loads ${CMAKE_MATCH_0}:\n${libraries}")
  endif()
endforeach()
# add_subdirectory: configured only (building it would compile the library a second time).
run(${CMAKE_COMMAND} -S ${source_dir}/subproject -B ${WORK_DIR}/subproject -G ${GENERATOR}
    -DKVSIFT_SOURCE_DIR=${source_dir}/../.. -DCMAKE_C_COMPILER=${C_COMPILER})
message(STATUS "consumer programs built and checked against ${prefix}")
