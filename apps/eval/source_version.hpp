// The source tree kvsift-eval was built from, for its provenance record.
#pragma once

namespace kvsift::eval {

// `git describe --always --dirty` of the source tree when CMake configured the build ("unknown"
// outside a git tree, or without git). Computed once: edits made after the configure are not seen.
const char* source_version();

}  // namespace kvsift::eval
