#include "lib/core/log.hpp"

namespace kvsift {
namespace {

struct Sink {
  LogFn fn = nullptr;
  void* user = nullptr;
  LogLevel min_level = LogLevel::info;
};

// The sink is set at start-up (the C API's thread-safety rule); readers copy it whole.
Sink g_sink;

}  // namespace

void set_log_sink(LogFn fn, void* user, LogLevel min_level) noexcept {
  g_sink = Sink{fn, user, min_level};
}

bool log_enabled(LogLevel level) noexcept {
  return g_sink.fn != nullptr && level >= g_sink.min_level;
}

void log(LogLevel level, const std::string& message) noexcept {
  const Sink sink = g_sink;
  if (sink.fn != nullptr && level >= sink.min_level) sink.fn(level, message.c_str(), sink.user);
}

}  // namespace kvsift
