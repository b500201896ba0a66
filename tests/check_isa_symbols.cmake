# Fails when an ISA object defines a weak (W/V) or unique (u) symbol other than the personality
# reference every C++ object carries.
foreach(obj IN LISTS OBJECTS)
  execute_process(COMMAND ${NM} -C --defined-only ${obj} OUTPUT_VARIABLE syms RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "nm failed on ${obj}")
  endif()
  string(REGEX MATCHALL "[^\n]* [WVu] [^\n]*" weak "${syms}")
  list(FILTER weak EXCLUDE REGEX "DW\\.ref\\.__gxx_personality_v0")
  if(weak)
    message(FATAL_ERROR "${obj} defines weak symbols:\n${weak}")
  endif()
  message(STATUS "${obj}: no weak symbols")
endforeach()
