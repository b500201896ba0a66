// kvsift's error type. Cold paths (create, validate, load) throw Error; lib/capi turns it into a
// status and a message. Hot paths are noexcept and run on inputs validated before them.
#pragma once

#include <exception>
#include <sstream>
#include <string>
#include <utility>

namespace kvsift {

// Mirrors kvsift_status value for value (lib/capi checks this at compile time).
enum class Status {
  ok = 0,
  invalid_argument = 1,
  unsupported = 2,
  out_of_memory = 3,
  capacity_exceeded = 4,
  not_found = 5,
  io_error = 6,
  invalid_file = 7,
  internal = 8,
  buffer_too_small = 9,
};

class Error : public std::exception {
 public:
  Error(Status status, std::string message) : status_(status), message_(std::move(message)) {}
  Status status() const noexcept { return status_; }
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  Status status_;
  std::string message_;
};

// Throws Error(status, the parts streamed together): fail(Status::invalid_argument, "head_dim=",
// d, " is not 64, 128 or 256").
template <class... Parts>
[[noreturn]] void fail(Status status, const Parts&... parts) {
  std::ostringstream message;
  (message << ... << parts);
  throw Error(status, message.str());
}

// Throws invalid_argument with the message when the condition is false.
template <class... Parts>
void require(bool condition, const Parts&... parts) {
  if (!condition) fail(Status::invalid_argument, parts...);
}

}  // namespace kvsift
