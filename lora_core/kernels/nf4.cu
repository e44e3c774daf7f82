// nf4.cu: blockwise NF4 quantisation and dequantisation of a frozen weight (QLoRA, Dettmers et al. 2023).
//
// What it computes (same arithmetic as lora_core/nf4.py's torch reference, which the tests compare
// bit for bit):
//   nf4_quantize:   per block b of BLOCK = 64 consecutive elements of the flattened row-major weight,
//                   absmax[b] = max |w|; inv = absmax > 0 ? 1 / absmax : 0; x = w * inv (fp32);
//                   code = number of NF4 midpoints m_i (fp32, (c_i + c_{i+1}) / 2) with x > m_i;
//                   element 2j goes to the high nibble of byte j, element 2j+1 to the low nibble.
//   absmax_quantize: double quantisation of the absmaxes: centred = absmax - mean (mean given);
//                   per block of 256 centred values, scale = max |centred| (fp32);
//                   q = rint(centred / scale * 127) as int8 (0 when scale == 0).
//   nf4_dequantize: out[i] = code_value[nibble(i)] * absmax(i / BLOCK), with the absmax recovered as
//                   q * (scale / 127) + mean when double-quantised, or, for a state read from bitsandbytes
//                   (its nested absmax: uint8 indices into a 256-entry dynamic map dcode),
//                   dcode[q] * scale + mean, the multiply and the add each rounded as bitsandbytes' own
//                   kernels and torch add round them; written in the output dtype.
// Assumptions: n is a multiple of BLOCK (64); tensors are contiguous; packed holds n / 2 bytes; the
//   dequantize launch covers n / 8 work items (DEQ_ITEMS per thread), each reading 4 packed bytes (one
//   32-bit load, so packed must be 4-byte aligned: torch allocations are) and writing 8 outputs with one
//   16-byte store (bf16/fp16) or two (fp32): out must be 16-byte aligned (torch allocations are).
// Checked by: tests/test_nf4.py (reference, CPU) and tiers/quick/test_nf4_kernels.py (these kernels vs it).
#include "float_convert.cuh"

#define NF4_BLOCK 64

__constant__ float NF4_CODE[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};

__device__ __forceinline__ unsigned char nf4_code(float x) {
    unsigned char c = 0;
#pragma unroll
    for (int i = 0; i < 15; ++i) {
        float mid = (NF4_CODE[i] + NF4_CODE[i + 1]) * 0.5f;
        c += (x > mid) ? 1 : 0;
    }
    return c;
}

// One warp per 64-element block: lane l handles elements 2l and 2l+1 and writes byte l of the block.
template <typename T>
__global__ void nf4_quantize(const T* __restrict__ w, unsigned char* __restrict__ packed,
                             float* __restrict__ absmax, long long n_blocks) {
    long long block = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (block >= n_blocks) return;  // whole warps exit together: the shuffles below stay full-warp
    const T* src = w + block * NF4_BLOCK + 2 * lane;
    float a = to_f<T>(src[0]), b = to_f<T>(src[1]);
    float m = fmaxf(fabsf(a), fabsf(b));
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    float inv = m > 0.0f ? 1.0f / m : 0.0f;
    packed[block * (NF4_BLOCK / 2) + lane] = (unsigned char)((nf4_code(a * inv) << 4) | nf4_code(b * inv));
    if (lane == 0) absmax[block] = m;
}

// One 256-thread block per 256 absmaxes (the last block may be partial).
__global__ void absmax_quantize(const float* __restrict__ absmax, float mean, signed char* __restrict__ q,
                                float* __restrict__ scale, long long n) {
    __shared__ float red[256];
    long long i = (long long)blockIdx.x * 256 + threadIdx.x;
    float c = i < n ? absmax[i] - mean : 0.0f;
    red[threadIdx.x] = fabsf(c);
    __syncthreads();
    for (int s = 128; s > 0; s >>= 1) {
        if (threadIdx.x < s) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + s]);
        __syncthreads();
    }
    float sc = red[0];
    if (threadIdx.x == 0) scale[blockIdx.x] = sc;
    if (i < n) q[i] = sc > 0.0f ? (signed char)rintf(c / sc * 127.0f) : (signed char)0;
}


__device__ __forceinline__ float block_absmax(long long blk, const float* absmax, const signed char* q,
                                              const float* scale, float mean, const float* dcode) {
    if (absmax != nullptr) return absmax[blk];
    if (dcode != nullptr)  // bitsandbytes' nested absmax: q is an unsigned index into its dynamic map
        return __fadd_rn(__fmul_rn(dcode[(unsigned char)q[blk]], scale[blk / 256]), mean);
    // explicit round-to-nearest mul and add: no FMA contraction, so the result matches the torch reference
    return __fadd_rn(__fmul_rn((float)q[blk], scale[blk / 256] / 127.0f), mean);
}

// Work item i: elements 8i .. 8i+7 (4 packed bytes, one block's absmax). Each thread takes ITEMS items
// blockDim apart, issuing all their loads before any use (more bytes in flight; every load and store
// instruction stays coalesced across the warp). The code table is copied to shared memory first: lanes of
// a warp look up different codes, which __constant__ memory would serialise (it broadcasts one address per
// access; this kernel ran at 16% of copy bandwidth on the H200 that way, 58-64% with one item per thread).
#define DEQ_ITEMS 4
template <typename T>
__global__ void nf4_dequantize(const unsigned int* __restrict__ packed4, const float* __restrict__ absmax,
                               const signed char* __restrict__ q, const float* __restrict__ scale, float mean,
                               const float* __restrict__ dcode, T* __restrict__ out, long long n8) {
    __shared__ float code[16];
    if (threadIdx.x < 16) code[threadIdx.x] = NF4_CODE[threadIdx.x];
    __syncthreads();
    long long first = (long long)blockIdx.x * blockDim.x * DEQ_ITEMS + threadIdx.x;
    unsigned int words[DEQ_ITEMS];
    float am[DEQ_ITEMS];
#pragma unroll
    for (int k = 0; k < DEQ_ITEMS; ++k) {
        long long i = first + (long long)k * blockDim.x;
        if (i < n8) {
            words[k] = packed4[i];
            am[k] = block_absmax((8 * i) / NF4_BLOCK, absmax, q, scale, mean, dcode);
        }
    }
#pragma unroll
    for (int k = 0; k < DEQ_ITEMS; ++k) {
        long long i = first + (long long)k * blockDim.x;
        if (i >= n8) break;
        __align__(16) T vals[8];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            unsigned int byte = (words[k] >> (8 * j)) & 0xffu;  // little-endian: byte j of word i is packed[4i + j]
            vals[2 * j] = from_f<T>(code[byte >> 4] * am[k]);
            vals[2 * j + 1] = from_f<T>(code[byte & 0xfu] * am[k]);
        }
        uint4* dst = reinterpret_cast<uint4*>(out + 8 * i);
        const uint4* src = reinterpret_cast<const uint4*>(vals);
#pragma unroll
        for (int c = 0; c < (int)(8 * sizeof(T) / 16); ++c) dst[c] = src[c];
    }
}
