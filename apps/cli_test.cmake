# One command-line test (apps/cli_tests.cmake registers them): runs a program with the arguments
# after "--" and checks its exit status and that its output (stdout and stderr) matches a regex.
# Inputs: -DEXPECT_EXIT=<status> -DEXPECT_OUTPUT=<regex> -P cli_test.cmake -- <program> <args>...
set(command)
set(after_separator FALSE)
math(EXPR last "${CMAKE_ARGC} - 1")
foreach(i RANGE ${last})
  if(after_separator)
    list(APPEND command "${CMAKE_ARGV${i}}")
  elseif(CMAKE_ARGV${i} STREQUAL "--")
    set(after_separator TRUE)
  endif()
endforeach()
execute_process(COMMAND ${command} RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err
                TIMEOUT 20)
if(NOT status STREQUAL EXPECT_EXIT)
  message(FATAL_ERROR "${command}\nexited ${status}, expected ${EXPECT_EXIT}:\n${out}${err}")
endif()
if(NOT "${out}${err}" MATCHES "${EXPECT_OUTPUT}")
  message(FATAL_ERROR "${command}\nprinted no match for '${EXPECT_OUTPUT}':\n${out}${err}")
endif()
