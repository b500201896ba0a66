// The names the apps' --kv-dtype flags take, one table for all of them: a storage type the library
// gains is one line here.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "kvsift/kvsift.h"

namespace kvsift::apps {

inline const std::map<std::string, kvsift_dtype>& kv_dtype_names() {
  static const std::map<std::string, kvsift_dtype> names{
      {"f16", KVSIFT_DTYPE_F16}, {"bf16", KVSIFT_DTYPE_BF16}, {"q8", KVSIFT_DTYPE_Q8}};
  return names;
}

// The names as a list: CLI11's IsMember choices, which --help prints.
inline std::vector<std::string> kv_dtype_list() {
  std::vector<std::string> list;
  for (const auto& entry : kv_dtype_names()) list.push_back(entry.first);
  return list;
}

}  // namespace kvsift::apps
