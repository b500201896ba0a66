// Process-wide log sink. Silent unless the host installs a callback through the C API.
#pragma once

#include <string>

namespace kvsift {

enum class LogLevel { debug = 0, info = 1, warn = 2, error = 3 };

using LogFn = void (*)(LogLevel level, const char* message, void* user);

void set_log_sink(LogFn fn, void* user, LogLevel min_level) noexcept;
bool log_enabled(LogLevel level) noexcept;
void log(LogLevel level, const std::string& message) noexcept;

}  // namespace kvsift
