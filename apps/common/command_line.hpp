// What every kvsift program's command line shares (apps/ and the CLI11 bench drivers): --version,
// defaults and the exit statuses in --help, CLI11's errors mapped to kExitUsage, validators for
// the ranges CLI11 lacks, and the device and file checks that must run before a model loads.
// Header-only: the bench drivers link different kvsift targets, all with the C API.
#pragma once

#include <CLI/CLI.hpp>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "common/exit_codes.hpp"
#include "kvsift/kvsift.h"

namespace kvsift::apps {

// A command line that parsed but breaks a rule across options (or a file check): thrown by a
// program's validation function, reported like CLI11's own errors and exited with `code`.
struct UsageError : CLI::ParseError {
  UsageError(const std::string& message, int code = kExitUsage)
      : CLI::ParseError("UsageError", message, code) {}
};

// Call first, before any option is added: --version, defaults shown in --help, the exit statuses
// as the footer.
inline void set_up_command_line(CLI::App& app, const std::string& program) {
  app.option_defaults()->always_capture_default();
  app.set_version_flag("--version", program + " (kvsift " + kvsift_version_string() + ")",
                       "print the program's name and the kvsift library's version, then exit");
  app.footer(kExitCodesHelp);
}

// Parses argv, then runs the program's one validation function. Returns the status to exit with
// when the program must stop here (--help, --version: kExitOk; any error: its message on stderr
// and kExitUsage or the UsageError's code), or nothing when it should run.
template <class Validate>
std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv, Validate validate) {
  try {
    app.parse(argc, argv);
    validate();
  } catch (const UsageError& e) {
    std::fprintf(stderr, "%s: %s\nRun with --help for more information.\n",
                 app.get_name().c_str(), e.what());
    return e.get_exit_code();
  } catch (const CLI::ParseError& e) {
    // CLI11's own codes (100 and up) become the one usage status; --help and --version are 0.
    const int code = app.exit(e);
    return code == 0 ? kExitOk : kExitUsage;
  }
  return std::nullopt;
}

// A number in the half-open interval (low, high]: CLI::Range is closed on both ends, and the
// library refuses a top_p or a budget of 0.
inline CLI::Validator above_and_at_most(double low, double high) {
  const auto text = [](double x) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.10g", x);
    return std::string(buf);
  };
  const std::string range = "(" + text(low) + ", " + text(high) + "]";
  return CLI::Validator(
      [low, high, range](std::string& input) -> std::string {
        double x = 0.0;
        if (!CLI::detail::lexical_cast(input, x)) return "'" + input + "' is not a number";
        if (!(x > low && x <= high)) return "value " + input + " not in " + range;
        return {};
      },
      "NUMBER in " + range);
}

// --device and --select-on: "cpu", "cuda" or "cuda:N"; -1 for the CPU, else the device index.
inline CLI::Validator device_name() {
  return CLI::Validator(
      [](std::string& input) -> std::string {
        if (input == "cpu" || input == "cuda") return {};
        if (input.rfind("cuda:", 0) == 0 && input.size() > 5 && input.size() <= 8 &&
            input.find_first_not_of("0123456789", 5) == std::string::npos)
          return {};
        return "'" + input + "' is not cpu, cuda or cuda:N";
      },
      "{cpu,cuda,cuda:N}");
}
inline int device_index(const std::string& device) {
  if (device == "cpu") return -1;
  if (device == "cuda") return 0;
  return std::stoi(device.substr(5));  // device_name() admitted only digits after "cuda:"
}

// A file the run reads (the model, a prompt): a UsageError with kExitInputUnreadable before the
// run when it cannot be opened, naming the option and the reason.
inline void require_readable_file(const std::string& option, const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw UsageError(option + " " + path + ": is a directory, not a file", kExitInputUnreadable);
  if (::access(path.c_str(), R_OK) != 0)
    throw UsageError(option + " " + path + ": " + std::strerror(errno), kExitInputUnreadable);
}

// A file the run writes: its folder must exist and be writable and the path must not be a folder;
// a UsageError with kExitOutputUnwritable otherwise. An existing file is replaced, as before.
inline void require_writable_file(const std::string& option, const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (path.empty() || path.back() == '/' || fs::is_directory(path, ec))
    throw UsageError(option + " " + path + ": is a folder; give a file name",
                     kExitOutputUnwritable);
  const fs::path parent = fs::path(path).parent_path().empty() ? fs::path(".")
                                                                : fs::path(path).parent_path();
  if (!fs::is_directory(parent, ec))
    throw UsageError(option + " " + path + ": no folder " + parent.string(),
                     kExitOutputUnwritable);
  if (::access(parent.c_str(), W_OK) != 0 ||
      (fs::exists(path, ec) && ::access(path.c_str(), W_OK) != 0))
    throw UsageError(option + " " + path + ": not writable (" + std::strerror(errno) + ")",
                     kExitOutputUnwritable);
}

// A folder the run writes into (created when missing): the path must not be a file, and its
// nearest existing ancestor must be a writable folder.
inline void require_writable_folder(const std::string& option, const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(path, ec) && !fs::is_directory(path, ec))
    throw UsageError(option + " " + path + ": is a file, not a folder", kExitOutputUnwritable);
  fs::path existing = fs::absolute(path, ec);
  while (!existing.empty() && !fs::exists(existing, ec)) existing = existing.parent_path();
  if (!fs::is_directory(existing, ec))
    throw UsageError(option + " " + path + ": " + existing.string() + " is not a folder",
                     kExitOutputUnwritable);
  if (::access(existing.c_str(), W_OK) != 0)
    throw UsageError(option + " " + path + ": " + existing.string() + " is not writable",
                     kExitOutputUnwritable);
}

}  // namespace kvsift::apps
