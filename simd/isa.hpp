// Instruction-set detection and the process-wide cap. Private to kvsift.
#pragma once

#include <optional>
#include <string_view>

namespace kvsift::simd {

// Ordered: a higher value includes everything a lower one needs.
enum class Isa { scalar = 0, avx2 = 1, avx512 = 2 };

// The best ISA the CPU and OS support. __builtin_cpu_supports checks CPUID and that the OS saves
// the vector state (XCR0); xsimd 8.1's own detector misreads AVX on Zen 5 and skips XCR0.
Isa detect_isa() noexcept;

// The cap: KVSIFT_MAX_ISA at first use, then whatever set_max_isa stored. Unknown values of the
// environment variable are ignored (reported by env_max_isa_error()).
Isa max_isa() noexcept;
void set_max_isa(Isa cap) noexcept;
// Non-empty when KVSIFT_MAX_ISA held a value that is not an ISA name.
std::string_view env_max_isa_error() noexcept;

// min(requested, detect_isa(), max_isa()).
Isa resolve_isa(Isa requested) noexcept;

const char* isa_name(Isa isa) noexcept;
std::optional<Isa> parse_isa(std::string_view name) noexcept;

}  // namespace kvsift::simd
