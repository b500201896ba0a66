# Fails unless the CUDA backend module (MODULE) exports kvsift_cuda_backend_open alone and every
# symbol it needs comes from the C and C++ runtimes, OpenMP or CUDA (gpu/backend.hpp: the module
# needs nothing of the host library, so it loads beside any kvsift of its interface version).
execute_process(COMMAND ${NM} -D --defined-only ${MODULE} OUTPUT_VARIABLE defined
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "nm failed on ${MODULE}")
endif()
string(REGEX MATCHALL "[^\n]* [A-Za-z] [^\n]*" exported "${defined}")
list(FILTER exported EXCLUDE REGEX " kvsift_cuda_backend_open$")
if(exported)
  message(FATAL_ERROR "${MODULE} exports more than its entry point:\n${exported}")
endif()
execute_process(COMMAND ${NM} -D --undefined-only ${MODULE} OUTPUT_VARIABLE undefined
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "nm failed on ${MODULE}")
endif()
string(REGEX MATCHALL "[^\n]+" needed "${undefined}")
# The versions name the library: glibc, libstdc++, libgcc, libgomp, the CUDA runtime and cuBLAS;
# the rest are the toolchain's weak hooks.
list(FILTER needed EXCLUDE REGEX "@(GLIBC|GLIBCXX|CXXABI|GCC|GOMP|OMP)_")
list(FILTER needed EXCLUDE REGEX " (__)?(cuda|cublas)[A-Za-z0-9_]*@lib(cudart|cublas)\\.so")
list(FILTER needed EXCLUDE REGEX " (_ITM_(de)?registerTMCloneTable|__gmon_start__)$")
if(needed)
  message(FATAL_ERROR "${MODULE} needs symbols outside the runtimes:\n${needed}")
endif()
message(STATUS "${MODULE}: exports kvsift_cuda_backend_open alone; needs only runtime symbols")
