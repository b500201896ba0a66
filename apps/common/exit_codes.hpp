// The exit statuses of every kvsift program (apps/ and the CLI11 bench drivers): the one list,
// which each program's --help footer prints (apps/common/command_line.hpp).
#pragma once

namespace kvsift::apps {

enum ExitCode : int {
  kExitOk = 0,               // done (also --help and --version)
  kExitFailure = 1,          // the run failed after it started (the library refused, a step threw)
  kExitUsage = 2,            // a bad command line: unknown option, value out of range, bad mix
  kExitInputUnreadable = 3,  // the model, a prompt, token or task file cannot be read
  kExitOutputUnwritable = 4, // an output path cannot be written (checked before the run)
  kExitCheckFailed = 5,      // the run finished but a check it makes failed (bench rows)
};

// The footer of --help: the list above, in words.
inline constexpr const char* kExitCodesHelp =
    "Exit status: 0 done; 1 run-time failure; 2 usage error (bad option or value); 3 model or "
    "input file unreadable; 4 output path unwritable; 5 a check the run makes failed.";

}  // namespace kvsift::apps
