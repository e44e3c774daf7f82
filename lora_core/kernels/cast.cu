// cast.cu: the fp32 -> 16-bit adapter casts of the LoRA op, both adapters in one launch.
//
// What it computes: out[i] = (Dst) a[i] for i in [0, n_a) and out[n_a + j] = (Dst) b[j] for j in [0, n_b),
// round-to-nearest-even: fp32 adapters A (r, K) and B (O, r) cast to the bf16/fp16 activation dtype
// before the adapter GEMMs (the gradients come back as fp32 straight out of cuBLAS). One launch for the
// pair halves the launches (host time) of the per-call casts.
// Assumptions: `a`, `b` and `out` are contiguous and do not overlap; `out` holds n_a + n_b elements; any
//   alignment; any sizes (grid-stride loop, no vector loads, so odd sizes need no tail handling).
// Checked by: tiers/quick/test_layer_parity.py (fp32 adapters under bf16/fp16 activations).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

template <typename Dst> __device__ __forceinline__ Dst from_float(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

template <typename Dst>
__global__ void cast_pair_from_f32(const float* __restrict__ a, const float* __restrict__ b,
                                   Dst* __restrict__ out, long long n_a, long long n_b) {
    long long stride = (long long)gridDim.x * blockDim.x;
    long long n = n_a + n_b;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = from_float<Dst>(i < n_a ? a[i] : b[i - n_a]);
    }
}
