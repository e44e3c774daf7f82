// swiglu.cu: the gated activation of a fused LoRA MLP (SwiGLU; GeGLU with the tanh GELU), forward and an in-place
// backward that recomputes the activation. The math below is SwiGLU's; GeGLU's differs only in f and df (Silu,
// GeluTanh further down).
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
// Assumptions: contiguous gu and act/dact, 16-byte aligned (torch's allocations are) when VEC > 1, with I a
// multiple of VEC; any N (grid-stride); each element is read before it is written, by the same thread only.
// Checked by: tiers/quick/test_fused_parity.py (against float64, both activations); selftest-gpu plants a dropped
// silu' term.
#include "float_convert.cuh"

// sigmoid in fp32: exact expf and division for fp32 activations (the parity bar is fp32's), the fast intrinsics
// for 16-bit ones, whose rounding (2^-8, 2^-11) is far above the intrinsics' error (about 2^-21 relative).
template <typename T> __device__ __forceinline__ float sigmoid_f(float x) { return __frcp_rn(1.0f + __expf(-x)); }
template <> __device__ __forceinline__ float sigmoid_f<float>(float x) { return 1.0f / (1.0f + expf(-x)); }

// The gate activations f and their derivatives df, in fp32 (the kernels below are written once over them):
//   SiLU (SwiGLU, Llama):        f = x σ(x),                  df = σ(x) (1 + x (1 - σ(x)))
//   GELU, tanh form (GeGLU, Gemma's gelu_pytorch_tanh): with u = k0 (x + k1 x³), t = tanh(u), k0 = √(2/π), k1 = 0.044715,
//                                f = x (1 + t) / 2,           df = (1 + t) / 2 + x (1 - t²) k0 (1 + 3 k1 x²) / 2
struct Silu {
    template <typename T> __device__ static __forceinline__ float f(float x) { return x * sigmoid_f<T>(x); }
    template <typename T> __device__ static __forceinline__ float f_df(float x, float& df) {
        const float sig = sigmoid_f<T>(x);
        df = sig * (1.0f + x * (1.0f - sig));
        return x * sig;
    }
};
struct GeluTanh {
    template <typename T> __device__ static __forceinline__ float f(float x) {
        return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
    }
    template <typename T> __device__ static __forceinline__ float f_df(float x, float& df) {
        const float t = tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x));
        df = 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * 0.7978845608028654f * (1.0f + 3.0f * 0.044715f * x * x);
        return 0.5f * x * (1.0f + t);
    }
};

// VEC elements per thread, moved as one aligned vector (16 bytes for VEC = 8 of a 16-bit type or 4 of fp32);
// the launcher picks VEC = 1 when I is not a multiple of the vector width.
template <typename T, int VEC> struct alignas(sizeof(T) * VEC) Pack { T v[VEC]; };

// Grid: x over a row's I / VEC vectors, y over rows (grid-stride both ways): no thread divides an index.
template <typename T, int VEC, typename Act>
__device__ __forceinline__ void gated_forward(const T* __restrict__ gu, T* __restrict__ act, long long n_rows,
                                              long long inter) {
    using P = Pack<T, VEC>;
    const long long n_vec = inter / VEC, col_stride = (long long)gridDim.x * blockDim.x;
    for (long long row = blockIdx.y; row < n_rows; row += gridDim.y) {
        const P* g = reinterpret_cast<const P*>(gu + row * 2 * inter);
        const P* u = reinterpret_cast<const P*>(gu + row * 2 * inter + inter);
        P* a = reinterpret_cast<P*>(act + row * inter);
        for (long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x; c < n_vec; c += col_stride) {
            P gv = g[c], uv = u[c], out;
#pragma unroll
            for (int j = 0; j < VEC; ++j)
                out.v[j] = from_f<T>(Act::template f<T>(to_f<T>(gv.v[j])) * to_f<T>(uv.v[j]));
            a[c] = out;
        }
    }
}

// In place: g <- d·u·df(g), u <- d·f(g), dact <- f(g)·u (the header's backward, for any gate activation).
template <typename T, int VEC, typename Act>
__device__ __forceinline__ void gated_backward_inplace(T* __restrict__ dact, T* __restrict__ gu, long long n_rows,
                                                       long long inter) {
    using P = Pack<T, VEC>;
    const long long n_vec = inter / VEC, col_stride = (long long)gridDim.x * blockDim.x;
    for (long long row = blockIdx.y; row < n_rows; row += gridDim.y) {
        P* g = reinterpret_cast<P*>(gu + row * 2 * inter);
        P* u = reinterpret_cast<P*>(gu + row * 2 * inter + inter);
        P* d = reinterpret_cast<P*>(dact + row * inter);
        for (long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x; c < n_vec; c += col_stride) {
            P gv = g[c], uv = u[c], dv = d[c], dg, du, a;
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                float x = to_f<T>(gv.v[j]), y = to_f<T>(uv.v[j]), z = to_f<T>(dv.v[j]), df;
                const float f = Act::template f_df<T>(x, df);
                dg.v[j] = from_f<T>(z * y * df);
                du.v[j] = from_f<T>(z * f);
                a.v[j] = from_f<T>(f * y);
            }
            g[c] = dg;
            u[c] = du;
            d[c] = a;
        }
    }
}

template <typename T, int VEC>
__global__ void swiglu_forward(const T* __restrict__ gu, T* __restrict__ act, long long n_rows, long long inter) {
    gated_forward<T, VEC, Silu>(gu, act, n_rows, inter);
}
template <typename T, int VEC>
__global__ void swiglu_backward_inplace(T* __restrict__ dact, T* __restrict__ gu, long long n_rows, long long inter) {
    gated_backward_inplace<T, VEC, Silu>(dact, gu, n_rows, inter);
}
template <typename T, int VEC>
__global__ void geglu_forward(const T* __restrict__ gu, T* __restrict__ act, long long n_rows, long long inter) {
    gated_forward<T, VEC, GeluTanh>(gu, act, n_rows, inter);
}
template <typename T, int VEC>
__global__ void geglu_backward_inplace(T* __restrict__ dact, T* __restrict__ gu, long long n_rows, long long inter) {
    gated_backward_inplace<T, VEC, GeluTanh>(dact, gu, n_rows, inter);
}
