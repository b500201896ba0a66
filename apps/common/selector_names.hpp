// The selectors' names for help strings, from the library's one table (lib/select/registry.hpp)
// through the C API, so that no app lists them by hand.
#pragma once

#include <string>
#include <vector>

#include "kvsift/kvsift.h"

namespace kvsift::apps {

// "dense, oracle, ..., louver" with the separator given; last_separator (when not null) before the
// last name instead ("dense, oracle, ... or louver").
inline std::string selector_names(const char* separator = ", ",
                                  const char* last_separator = nullptr) {
  std::string names;
  for (int i = 0; i < KVSIFT_SELECTOR_COUNT; ++i) {
    if (i > 0)
      names += i + 1 == KVSIFT_SELECTOR_COUNT && last_separator ? last_separator : separator;
    names += kvsift_selector_name(static_cast<kvsift_selector>(i));
  }
  return names;
}

// The names as a list: CLI11's IsMember choices, which --help prints.
inline std::vector<std::string> selector_list() {
  std::vector<std::string> names;
  for (int i = 0; i < KVSIFT_SELECTOR_COUNT; ++i)
    names.push_back(kvsift_selector_name(static_cast<kvsift_selector>(i)));
  return names;
}

}  // namespace kvsift::apps
