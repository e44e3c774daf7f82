// float_convert.cuh: the conversions every RawKernel of lora_core uses between its storage dtype T (fp32, bf16,
// fp16) and the fp32 it computes in. to_f is exact (bf16 and fp16 are subsets of fp32); from_f rounds to nearest
// even, once. lora_core.ops.cupy_interop.kernel_source pastes this file in place of its #include line, so the code
// CuPy compiles (and keys its disk cache on) holds it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

template <typename T> __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
