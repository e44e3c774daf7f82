// swiglu.cu: the SwiGLU of a fused LoRA MLP, forward and an in-place backward that recomputes the activation.
//
// Layout: gu is (N, 2I) row-major, the gate pre-activations g in columns [0, I), the up ones u in [I, 2I)
// (both projections come out of one GEMM over X).
// Forward:  act[n, i] = silu(g) * u,  silu(g) = g * sigmoid(g),  computed in fp32, rounded once to T.
// Backward (in place, nothing saved but gu): with d = dact[n, i], σ = sigmoid(g), silu = g σ,
//   silu'(g) = σ (1 + g (1 - σ))
//   dg = d * u * silu'(g)     -> written over g
//   du = d * silu(g)          -> written over u
//   act = silu(g) * u         -> written over d (the down projection's dA needs it; the forward did not keep it)
// so gu becomes d(gu), the buffer the gate and up backward GEMMs read as one operand.
// Assumptions: contiguous gu and act/dact; any N, I (grid-stride); each element read before it is written by
// the same thread only.
// Checked by: tiers/quick/test_fused_parity.py (against float64); selftest-gpu plants a dropped silu' term.
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

// Grid: x over the columns of a row, y over rows (grid-stride both ways), so no thread divides an index.
template <typename T>
__global__ void swiglu_forward(const T* __restrict__ gu, T* __restrict__ act, long long n_rows, long long inter) {
    long long col_stride = (long long)gridDim.x * blockDim.x;
    for (long long row = blockIdx.y; row < n_rows; row += gridDim.y) {
        const T* g = gu + row * 2 * inter;
        const T* u = g + inter;
        T* a = act + row * inter;
        for (long long col = (long long)blockIdx.x * blockDim.x + threadIdx.x; col < inter; col += col_stride) {
            float gv = to_f<T>(g[col]);
            float sig = 1.0f / (1.0f + expf(-gv));
            a[col] = from_f<T>(gv * sig * to_f<T>(u[col]));
        }
    }
}

template <typename T>
__global__ void swiglu_backward_inplace(T* __restrict__ dact, T* __restrict__ gu, long long n_rows, long long inter) {
    long long col_stride = (long long)gridDim.x * blockDim.x;
    for (long long row = blockIdx.y; row < n_rows; row += gridDim.y) {
        T* g = gu + row * 2 * inter;
        T* u = g + inter;
        T* d = dact + row * inter;
        for (long long col = (long long)blockIdx.x * blockDim.x + threadIdx.x; col < inter; col += col_stride) {
            float gv = to_f<T>(g[col]), uv = to_f<T>(u[col]), dv = to_f<T>(d[col]);
            float sig = 1.0f / (1.0f + expf(-gv));
            float silu = gv * sig;
            float dsilu = sig * (1.0f + gv * (1.0f - sig));
            g[col] = from_f<T>(dv * uv * dsilu);
            u[col] = from_f<T>(dv * silu);
            d[col] = from_f<T>(silu * uv);
        }
    }
}
