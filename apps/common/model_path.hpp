// Where the apps look for the model when --model is not given.
#pragma once

#include <string>

namespace kvsift::apps {

// KVSIFT_MODEL when set, else SmolLM2-135M-Instruct.Q4_1.gguf in KVSIFT_MODEL_DIR or
// ~/.cache/kvsift/models: where scripts/fetch_model.sh puts it.
std::string default_model_path();

}  // namespace kvsift::apps
