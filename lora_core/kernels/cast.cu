// cast.cu: the fp32 -> 16-bit adapter casts of the LoRA op, both adapters in one launch.
//
// What it computes: out[i] = (Dst) a[i] for i in [0, n_a) and out[n_a + j] = (Dst) b[j] for j in [0, n_b),
// round-to-nearest-even: fp32 adapters A (r, K) and B (O, r) cast to the bf16/fp16 activation dtype
// before the adapter GEMMs (the gradients come back as fp32 straight out of cuBLAS). One launch for the
// pair halves the launches (host time) of the per-call casts.
// Assumptions: `a`, `b` and `out` are contiguous and do not overlap; `out` holds n_a + n_b elements; any
//   alignment; any sizes (grid-stride loop, no vector loads, so odd sizes need no tail handling).
// Checked by: tiers/quick/test_layer_parity.py (fp32 adapters under bf16/fp16 activations).
#include "float_convert.cuh"

template <typename Dst>
__global__ void cast_pair_from_f32(const float* __restrict__ a, const float* __restrict__ b,
                                   Dst* __restrict__ out, long long n_a, long long n_b) {
    long long stride = (long long)gridDim.x * blockDim.x;
    long long n = n_a + n_b;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = from_f<Dst>(i < n_a ? a[i] : b[i - n_a]);
    }
}

// cast_stack_from_f32: up to six fp32 tensors cast into one buffer, back to back, in one launch: the adapters
// of a fused LoRA group (A_gate, A_up, B_gate, B_up, A_down, B_down for the MLP; A_q, A_k, A_v, B_q, B_k, B_v
// for QKV), so that the A's stack into one (Σr, K) operand that multiplies X once.
// What it computes: with ends e_0 <= ... <= e_5 (cumulative element counts; an unused source has e_i = e_{i-1}),
//   out[i] = (Dst) s_j[i - e_{j-1}] for e_{j-1} <= i < e_j.
// Assumptions: sources contiguous fp32, not overlapping `out`; `out` holds e_5 elements.
// Checked by: tiers/quick/test_fused_parity.py (fp32 adapters under bf16/fp16 activations).
template <typename Dst>
__global__ void cast_stack_from_f32(const float* __restrict__ s0, const float* __restrict__ s1,
                                    const float* __restrict__ s2, const float* __restrict__ s3,
                                    const float* __restrict__ s4, const float* __restrict__ s5,
                                    Dst* __restrict__ out, long long e0, long long e1, long long e2,
                                    long long e3, long long e4, long long e5) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < e5; i += stride) {
        float v;
        if (i < e0) v = s0[i];
        else if (i < e1) v = s1[i - e0];
        else if (i < e2) v = s2[i - e1];
        else if (i < e3) v = s3[i - e2];
        else if (i < e4) v = s4[i - e3];
        else v = s5[i - e4];
        out[i] = from_f<Dst>(v);
    }
}
