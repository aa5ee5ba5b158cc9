// The constants of the engine's vector exp (exp_avx2.h's exp_neg, vec512.h's exp_neg16): exp(x) for x <= 0 as
// 2^n * 2^f, n = round(x log2 e), f's exponential by Cephes' expf polynomial on [-0.5, 0.5] (relative error ~2e-7).
#pragma once

namespace ringstream_cpu::exp_poly {

constexpr float kLowest = -87.3f;  // arguments are clamped here: exp(-87.3) ~ 1e-38, a normal float
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;  // ln 2 in two parts: r = x - n ln2 exactly
// y = ((((c0 r + c1) r + c2) r + c3) r + c4) r + c5, then exp(r) = y r^2 + r + 1
constexpr float kCoefficients[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                   4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

}  // namespace ringstream_cpu::exp_poly
