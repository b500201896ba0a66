# Fails when an ISA object defines a weak (W/V) or unique (u) symbol that a baseline caller could
# be linked to. Allowed: the personality reference every C++ object carries, and templates
# instantiated on an xsimd architecture type (only that ISA's code names them; unoptimised or
# sanitizer builds emit some out of line).
foreach(obj IN LISTS OBJECTS)
  execute_process(COMMAND ${NM} -C --defined-only ${obj} OUTPUT_VARIABLE syms RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "nm failed on ${obj}")
  endif()
  string(REGEX MATCHALL "[^\n]* [WVu] [^\n]*" weak "${syms}")
  list(FILTER weak EXCLUDE REGEX "DW\\.ref\\.__gxx_personality_v0")
  list(FILTER weak EXCLUDE REGEX "xsimd::(avx512bw|avx2|fma3<xsimd::avx2>)[,>]")
  if(weak)
    message(FATAL_ERROR "${obj} defines weak symbols:\n${weak}")
  endif()
  message(STATUS "${obj}: no weak symbols")
endforeach()
