# Fails when an ISA object defines a weak (W/V) or unique (u) symbol that a baseline caller could
# be linked to. Allowed: the personality reference every C++ object carries, and templates
# instantiated on an xsimd architecture type (only that ISA's code names them; unoptimised or
# sanitizer builds emit some out of line), except in the VNNI object (below).
foreach(obj IN LISTS OBJECTS)
  execute_process(COMMAND ${NM} -C --defined-only ${obj} OUTPUT_VARIABLE syms RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "nm failed on ${obj}")
  endif()
  string(REGEX MATCHALL "[^\n]* [WVu] [^\n]*" weak "${syms}")
  list(FILTER weak EXCLUDE REGEX "DW\\.ref\\.__gxx_personality_v0")
  # Not for the VNNI object: its xsimd templates would be named like the AVX-512 objects' ones,
  # and its copies (compiled with VNNI) could replace theirs on a CPU without VNNI.
  get_filename_component(name ${obj} NAME)
  if(NOT name MATCHES "vnni")
    list(FILTER weak EXCLUDE REGEX "xsimd::(avx512bw|avx2|fma3<xsimd::avx2>)[,>]")
  endif()
  if(weak)
    message(FATAL_ERROR "${obj} defines weak symbols:\n${weak}")
  endif()
  message(STATUS "${obj}: no weak symbols")
endforeach()
