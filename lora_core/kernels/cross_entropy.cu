// cross_entropy.cu: one chunk of the fused linear cross-entropy: per row of logits, the loss and, in place, its
// gradient (lora_core/ops/linear_cross_entropy.py holds the plan around it).
//
// Layout: z is (R, V) row-major, the logits z_r = h_r Wᵀ of R tokens in T; targets (R,) int64. The 1/n of the
// token mean is not applied here (the caller scales the loss and the GEMMs' products): dz keeps entries of order 1,
// which fp16 holds as normal numbers (dz/n would fall among fp16's subnormals at n ~ 10³, V ~ 10⁴).
// Per row r with target t (computed in fp32):
//   m = max_j z_rj,  s = Σ_j exp(z_rj - m),  lse = m + log s
//   loss_rows[r] = lse - z_rt                         0 for t == ignore_index, NaN for t outside [0, V)
//   z_rj <- exp(z_rj - m) / s - [j == t]            0 for t == ignore_index   (n · d loss / d z_rj, rounded to T)
// With softcap c > 0 (Gemma 2's final_logit_softcapping) every z_rj above is first replaced by c·tanh(z_rj / c),
// and its gradient is multiplied by 1 - tanh²(z_rj / c) (the chain rule through the cap); c = 0: no cap.
// One block per row. Pass 1: each thread keeps an online (max, sum) over its strided columns; the block merges them
// (warp shuffles, then one warp over the warps' pairs). z_rt is read before the merge, whose barriers order it before
// any write. Pass 2: each thread rewrites its own columns. Columns move VEC at a time: 16-byte vectors (VEC = 8 for
// 16-bit T, 4 for fp32) when V is a multiple of VEC and z 16-byte aligned (the caller's rule), else one at a time.
// Assumptions: contiguous z, blockDim.x a multiple of 32, at most 1024 threads.
// Checked by: tiers/quick/test_fused_loss_parity.py (against float64); selftest-gpu plants a dropped [j == t] term.
#include "float_convert.cuh"

// exp in fp32: exact expf for fp32 logits (the parity bar is fp32's), the fast intrinsic for 16-bit ones, whose
// rounding (2^-8, 2^-11) is far above the intrinsic's error (about 2^-21 relative).
template <typename T> __device__ __forceinline__ float exp_f(float x) { return __expf(x); }
template <> __device__ __forceinline__ float exp_f<float>(float x) { return expf(x); }

#define NEG_INF __int_as_float(0xff800000)  // NVRTC defines no INFINITY

// Merge two (max, sum-of-exp relative to that max) pairs; a pair with max -inf holds no column.
template <typename T> __device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
    if (m2 == NEG_INF) return;
    if (m == NEG_INF) { m = m2; s = s2; return; }
    const float hi = fmaxf(m, m2);
    s = s * exp_f<T>(m - hi) + s2 * exp_f<T>(m2 - hi);
    m = hi;
}

__device__ __forceinline__ float capped(float v, float softcap) {
    return softcap > 0.0f ? softcap * tanhf(v / softcap) : v;
}

// VEC columns of T as one aligned load or store (VEC = 1: a plain T)
template <typename T, int VEC> struct alignas(sizeof(T) * VEC) Pack { T v[VEC]; };

template <typename T, int VEC>
__global__ void cross_entropy_rows(T* __restrict__ z, const long long* __restrict__ targets,
                                   float* __restrict__ loss_rows,
                                   long long vocab, long long ignore_index, float softcap) {
    __shared__ float warp_m[32], warp_s[32];
    T* zr = z + (long long)blockIdx.x * vocab;
    Pack<T, VEC>* zp = reinterpret_cast<Pack<T, VEC>*>(zr);
    const long long packs = vocab / VEC;  // the caller launches VEC > 1 only where V % VEC == 0
    const long long t = targets[blockIdx.x];
    const bool ignored = t == ignore_index, in_range = t >= 0 && t < vocab;
    const float zt = in_range ? capped(to_f(zr[t]), softcap) : 0.0f;  // read before the barriers, so before writes
    float m = NEG_INF, s = 0.0f;
    for (long long jp = threadIdx.x; jp < packs; jp += blockDim.x) {
        const Pack<T, VEC> p = zp[jp];
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            const float v = capped(to_f(p.v[e]), softcap);
            if (v > m) { s = s * exp_f<T>(m - v) + 1.0f; m = v; }  // m = -inf first: s * exp(-inf) = 0
            else { s += exp_f<T>(v - m); }
        }
    }
    for (int off = 16; off > 0; off >>= 1)
        merge<T>(m, s, __shfl_xor_sync(0xffffffffu, m, off), __shfl_xor_sync(0xffffffffu, s, off));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (lane == 0) { warp_m[warp] = m; warp_s[warp] = s; }
    __syncthreads();
    m = lane < warps ? warp_m[lane] : NEG_INF;
    s = lane < warps ? warp_s[lane] : 0.0f;
    for (int off = 16; off > 0; off >>= 1)
        merge<T>(m, s, __shfl_xor_sync(0xffffffffu, m, off), __shfl_xor_sync(0xffffffffu, s, off));
    // every lane of every warp now holds the row's (m, s): each warp merged the same 32 pairs
    if (threadIdx.x == 0)
        loss_rows[blockIdx.x] = ignored ? 0.0f : (in_range ? m + logf(s) - zt : __int_as_float(0x7fc00000));
    const float g = ignored ? 0.0f : 1.0f, inv_s = 1.0f / s;
    for (long long jp = threadIdx.x; jp < packs; jp += blockDim.x) {
        Pack<T, VEC> p = zp[jp];
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            const float v = capped(to_f(p.v[e]), softcap), q = exp_f<T>(v - m) * inv_s;
            const float chain = softcap > 0.0f ? 1.0f - (v / softcap) * (v / softcap) : 1.0f;
            p.v[e] = from_f<T>((q - (jp * VEC + e == t ? 1.0f : 0.0f)) * g * chain);
        }
        zp[jp] = p;
    }
}
