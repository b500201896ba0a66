#include "model_path.hpp"

#include <cstdlib>

namespace kvsift::apps {

std::string default_model_path() {
  if (const char* path = std::getenv("KVSIFT_MODEL")) return path;
  const char* dir = std::getenv("KVSIFT_MODEL_DIR");
  const char* home = std::getenv("HOME");
  const std::string base = dir ? dir : std::string(home ? home : ".") + "/.cache/kvsift/models";
  return base + "/SmolLM2-135M-Instruct.Q4_1.gguf";
}

}  // namespace kvsift::apps
