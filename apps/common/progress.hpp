// A progress report for a long step with a known total (the demo's prefill): rate and time left.
// On a terminal it redraws one bar in place; anywhere else (a log, a pipe, CI) it writes a plain
// line every few seconds, so that logs hold no carriage returns and stay short.
#pragma once

#include <unistd.h>

#include <chrono>
#include <utility>
#include <cstdint>
#include <cstdio>
#include <string>

namespace kvsift::apps {

class Progress {
 public:
  explicit Progress(std::string what) : what_(std::move(what)), tty_(isatty(fileno(stderr))) {}

  // For C callbacks of the form void(uint64_t done, uint64_t total, void* user), user = this.
  static void callback(uint64_t done, uint64_t total, void* self) {
    static_cast<Progress*>(self)->update(done, total);
  }

  void update(uint64_t done, uint64_t total) {
    const auto now = Clock::now();
    if (done == 0 || total == 0) {
      start_ = now;
      return;
    }
    const bool last = done >= total;
    const double since_shown = std::chrono::duration<double>(now - shown_).count();
    if (!last && since_shown < (tty_ ? kTerminalEverySeconds : kLogEverySeconds)) return;
    shown_ = now;
    const double elapsed = std::chrono::duration<double>(now - start_).count();
    const double rate = elapsed > 0 ? static_cast<double>(done) / elapsed : 0.0;
    const double left = rate > 0 ? static_cast<double>(total - done) / rate : 0.0;
    const auto d = static_cast<unsigned long long>(done);
    const auto t = static_cast<unsigned long long>(total);
    if (tty_) {
      const int filled = static_cast<int>(kWidth * done / total);
      std::fprintf(stderr, "\r%s [%s%s] %llu/%llu tokens, %.0f tokens/s, %s", what_.c_str(),
                   std::string(filled, '#').c_str(), std::string(kWidth - filled, '.').c_str(), d,
                   t, rate, last ? "done      " : ("ETA " + clock(left) + "   ").c_str());
      if (last) std::fprintf(stderr, "\n");
    } else {
      std::fprintf(stderr, "%s: %llu/%llu tokens, %.0f tokens/s, %s\n", what_.c_str(), d, t, rate,
                   last ? ("done in " + clock(elapsed)).c_str() : ("ETA " + clock(left)).c_str());
    }
  }

 private:
  using Clock = std::chrono::steady_clock;
  static constexpr int kWidth = 30;
  static constexpr double kTerminalEverySeconds = 0.1;
  static constexpr double kLogEverySeconds = 5.0;

  static std::string clock(double seconds) {
    const auto s = static_cast<long long>(seconds + 0.5);
    char buf[32];
    std::snprintf(buf, sizeof buf, "%lld:%02lld", s / 60, s % 60);
    return buf;
  }

  std::string what_;
  bool tty_;
  Clock::time_point start_ = Clock::now();
  Clock::time_point shown_ = start_;
};

}  // namespace kvsift::apps
