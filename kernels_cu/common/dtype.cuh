// Portable basics for every kernel: fixed-width integers, INFINITY, and the 16-bit float types.
// NVRTC ships no C/C++ standard headers (<cstdint>, <cmath> fail to open), so under NVRTC
// (__CUDACC_RTC__) the few names we use are defined here, inside namespace cf so that they can
// never clash with another header's global typedefs; under nvcc the standard headers are used.
#pragma once

#if defined(__CUDACC_RTC__)
namespace cf {
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
}  // namespace cf
#ifndef INFINITY
#define INFINITY (__int_as_float(0x7f800000))
#endif
#else
#include <cstdint>
#include <cmath>
#endif

#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace cf {

// Element-type names used in specialisation names and static checks.
template <typename T> struct DtypeInfo;
template <> struct DtypeInfo<__half> { static constexpr int kBytes = 2; };
template <> struct DtypeInfo<__nv_bfloat16> { static constexpr int kBytes = 2; };
template <> struct DtypeInfo<float> { static constexpr int kBytes = 4; };
template <> struct DtypeInfo<double> { static constexpr int kBytes = 8; };

// Scalar conversions to and from float / double accumulators.
template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
// The two 16-bit values packed in a 32-bit word (low half first) as floats, exactly (bf16: the
// bits moved into a float's upper half).
template <typename T> __device__ __forceinline__ float2 to_float2(uint32_t w);
template <> __device__ __forceinline__ float2 to_float2<__half>(uint32_t w) {
    return __half22float2(*reinterpret_cast<const __half2*>(&w));
}
template <> __device__ __forceinline__ float2 to_float2<__nv_bfloat16>(uint32_t w) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}
// float -> T, round to nearest even
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }

}  // namespace cf
