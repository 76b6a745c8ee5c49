// fp32 arithmetic on 16-byte packs of 8 x bf16 / fp16, and the block reduction used by RMSNorm.
// Everything here is deterministic: fixed operation order, no atomics, so every rank that feeds in the same
// bits gets the same bits out.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace sgl_sm120 {

template <typename T>
struct HalfCodec;

template <>
struct HalfCodec<__nv_bfloat16> {
  static __device__ __forceinline__ float low(uint32_t w) { return __uint_as_float(w << 16); }
  static __device__ __forceinline__ float high(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

template <>
struct HalfCodec<__half> {
  static __device__ __forceinline__ float low(uint32_t w) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xFFFFu)));
  }
  static __device__ __forceinline__ float high(uint32_t w) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

struct Acc8 {
  float v[8];
};

template <typename T>
__device__ __forceinline__ Acc8 unpack(uint4 p) {
  using C = HalfCodec<T>;
  Acc8 a;
  a.v[0] = C::low(p.x);
  a.v[1] = C::high(p.x);
  a.v[2] = C::low(p.y);
  a.v[3] = C::high(p.y);
  a.v[4] = C::low(p.z);
  a.v[5] = C::high(p.z);
  a.v[6] = C::low(p.w);
  a.v[7] = C::high(p.w);
  return a;
}

template <typename T>
__device__ __forceinline__ void accumulate(Acc8& a, uint4 p) {
  const Acc8 b = unpack<T>(p);
#pragma unroll
  for (int i = 0; i < 8; ++i) a.v[i] += b.v[i];
}

// Adds the packs of sources base .. base + kBatch - 1 (v[i] is source base + i) to `acc` in source order, source 0
// starting the sum. Every transport reduces through this one loop, batch after batch, so their sums agree bit for
// bit whatever their batch size.
template <typename T, int kBatch>
__device__ __forceinline__ void add_in_source_order(Acc8& acc, const uint4 (&v)[kBatch], int base) {
#pragma unroll
  for (int i = 0; i < kBatch; ++i) {
    if (base + i == 0) {
      acc = unpack<T>(v[i]);
    } else {
      accumulate<T>(acc, v[i]);
    }
  }
}

// Round once to the element type.
template <typename T>
__device__ __forceinline__ uint4 round_pack(const Acc8& a) {
  using C = HalfCodec<T>;
  return make_uint4(C::pack(a.v[0], a.v[1]), C::pack(a.v[2], a.v[3]), C::pack(a.v[4], a.v[5]),
                    C::pack(a.v[6], a.v[7]));
}

// fp32 partials travel as two 16-byte packs of raw float bits.
__device__ __forceinline__ uint4 partial_low(const Acc8& a) {
  return make_uint4(__float_as_uint(a.v[0]), __float_as_uint(a.v[1]), __float_as_uint(a.v[2]),
                    __float_as_uint(a.v[3]));
}
__device__ __forceinline__ uint4 partial_high(const Acc8& a) {
  return make_uint4(__float_as_uint(a.v[4]), __float_as_uint(a.v[5]), __float_as_uint(a.v[6]),
                    __float_as_uint(a.v[7]));
}
__device__ __forceinline__ Acc8 partial_from(uint4 lo, uint4 hi) {
  Acc8 a;
  a.v[0] = __uint_as_float(lo.x);
  a.v[1] = __uint_as_float(lo.y);
  a.v[2] = __uint_as_float(lo.z);
  a.v[3] = __uint_as_float(lo.w);
  a.v[4] = __uint_as_float(hi.x);
  a.v[5] = __uint_as_float(hi.y);
  a.v[6] = __uint_as_float(hi.z);
  a.v[7] = __uint_as_float(hi.w);
  return a;
}

template <typename T>
__device__ __forceinline__ float sum_of_squares(uint4 p) {
  const Acc8 a = unpack<T>(p);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) s += a.v[i] * a.v[i];
  return s;
}

// out = round(x * inv_rms * w), all in fp32, the order SGLang's unfused RMSNorm uses.
template <typename T>
__device__ __forceinline__ uint4 scale_pack(uint4 x, uint4 w, float inv_rms) {
  Acc8 a = unpack<T>(x);
  const Acc8 b = unpack<T>(w);
#pragma unroll
  for (int i = 0; i < 8; ++i) a.v[i] = (a.v[i] * inv_rms) * b.v[i];
  return round_pack<T>(a);
}

// Sum of one float per thread over the CTA, the same bits on every rank (fixed shuffle tree, then warp 0
// adds the per-warp sums in warp order). `scratch` holds at least 33 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int num_warps = (blockDim.x + 31) >> 5;
  __syncthreads();  // scratch may still be read by the previous row's broadcast
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float t = lane < num_warps ? scratch[lane] : 0.f;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) t += __shfl_xor_sync(0xffffffffu, t, offset);
    if (lane == 0) scratch[32] = t;
  }
  __syncthreads();
  return scratch[32];
}

}  // namespace sgl_sm120
