// The tensor-core product the .cu kernels share: mma.sync m16n8k16 with fp32 accumulators, both
// operands 16-bit (the K/V cache's fp16 or bf16), so that one wrapper owns the instruction and its
// fragment layout (PTX ISA, "Matrix Fragments for mma.m16n8k16").
#pragma once

#include <cstdint>

namespace kvsift::gpu {

// A warp's D (16x8, fp32) += A (16x16) B (16x8), bf16 operands when kBf16, else fp16. With
// g = lane / 4 and t = lane % 4: a[0] holds A[g][2t, 2t + 1], a[1] A[g + 8][2t, 2t + 1], a[2] and
// a[3] the same rows at columns 2t + 8 and 2t + 9; b0 holds B[2t, 2t + 1][g], b1
// B[2t + 8, 2t + 9][g] (the lower index in the low half); d[0], d[1] are D[g][2t, 2t + 1] and
// d[2], d[3] D[g + 8][2t, 2t + 1].
template <bool kBf16>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
  if constexpr (kBf16)
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace kvsift::gpu
