// The C++ wrapper compiled in a translation unit that includes it alone, with -Wall -Wextra
// -Wpedantic -Werror (tests/CMakeLists.txt): it must need nothing a user would not include.
#include "kvsift/kvsift.hpp"

// Called by tests/test_cpp_wrapper.cpp, so that this object is linked and its answer checked.
int kvsift_cpp_header_compiled_version() {
  return kvsift::compiled_version;
}
