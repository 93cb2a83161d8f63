// hspmd's 16-bit float storage types, included once after the portability layer
// (cuda_preamble.cuh or cuda_emu.h, which define hs_float_bits / hs_bits_float) and before
// hs_common.cuh, outside the CPU build's block-emulation namespaces (so both share one type).

// ---- 16-bit floats: bfloat16 and IEEE half as storage, float for arithmetic
// A tensor of bf16 or f16 is an array of `hs_bf16` / `hs_half` (16 bits each, the formats'
// layouts). They convert to float implicitly, and from float with round-to-nearest-even (NaN
// stays a quiet NaN, overflow gives infinity), as ml_dtypes and NumPy round: so a kernel reads
// them as floats, computes in float, and rounds once where it stores. Written with integer
// operations only, so the GPU and the CPU build round alike.
__device__ __forceinline__ unsigned short hs_float_to_bf16_bits(float f) {
  const unsigned u = hs_float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);  // a quiet NaN
  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ float hs_bf16_bits_to_float(unsigned short b) { return hs_bits_float((unsigned)b << 16); }
__device__ __forceinline__ unsigned short hs_float_to_half_bits(float f) {
  const unsigned u = hs_float_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a >= 0x47800000u) return (unsigned short)(sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u));  // >= 2^16: inf, NaN
  if (a < 0x38800000u) {  // below half's smallest normal (2^-14): a subnormal or zero, step 2^-24
    // adding 0.5 (exponent 126) leaves the value's multiple of 2^-24 in the low mantissa bits,
    // rounded to nearest even by the float addition itself
    const float t = hs_bits_float(a) + 0.5f;
    return (unsigned short)(sign | (hs_float_bits(t) - 0x3f000000u));
  }
  const unsigned odd = (a >> 13) & 1u;  // round to nearest even: carry into the exponent as needed
  return (unsigned short)(sign | ((a - 0x38000000u + 0xfffu + odd) >> 13));
}
__device__ __forceinline__ float hs_half_bits_to_float(unsigned short h) {
  const unsigned sign = ((unsigned)h & 0x8000u) << 16, e = ((unsigned)h >> 10) & 0x1fu, m = (unsigned)h & 0x3ffu;
  if (e == 31u) return hs_bits_float(sign | 0x7f800000u | (m << 13));
  if (e == 0u) {
    const float v = (float)m * 5.9604644775390625e-8f;  // m * 2^-24, exact
    return sign ? -v : v;
  }
  return hs_bits_float(sign | ((e + 112u) << 23) | (m << 13));
}
struct hs_bf16 {
  unsigned short bits;
  hs_bf16() = default;
  __device__ __forceinline__ hs_bf16(float f) : bits(hs_float_to_bf16_bits(f)) {}
  __device__ __forceinline__ operator float() const { return hs_bf16_bits_to_float(bits); }
};
struct hs_half {
  unsigned short bits;
  hs_half() = default;
  __device__ __forceinline__ hs_half(float f) : bits(hs_float_to_half_bits(f)) {}
  __device__ __forceinline__ operator float() const { return hs_half_bits_to_float(bits); }
};
// x rounded to the format (an op's result kept in float between the ops of one kernel)
__device__ __forceinline__ float hs_round_bf16(float x) { return (float)hs_bf16(x); }
__device__ __forceinline__ float hs_round_half(float x) { return (float)hs_half(x); }
