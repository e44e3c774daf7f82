// cast.cu: out[i] = (Dst) in[i] for i in [0, n), round-to-nearest-even.
//
// What it computes: the explicit dtype casts of the LoRA op, fp32 adapters -> the 16-bit activation
// dtype (bf16/fp16) before the adapter GEMMs (the gradients come back as fp32 straight out of cuBLAS).
// Assumptions: `in` and `out` are contiguous, do not overlap, and hold n elements; any alignment; n may
//   be any size (grid-stride loop, no vector loads, so odd sizes need no tail handling).
// Checked by: tiers/quick/test_layer_parity.py (fp32 adapters under bf16/fp16 activations).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

template <typename Dst> __device__ __forceinline__ Dst from_float(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

template <typename Dst>
__global__ void cast_from_f32(const float* __restrict__ in, Dst* __restrict__ out, long long n) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = from_float<Dst>(in[i]);
    }
}
