// quant.cu: weights read in their GGUF encoding (no f16 copy on the device).
//
// * `mmvq_<type>`: decode matmul for 1..MMVQ_MAX_ROWS activation rows, as
//   llama.cpp's MMVQ: activations quantized per 32-element block to int8 with
//   their scale and block sum (`Q8`, kestrel-cpu's fast-numerics `Q8Block`),
//   integer dot products (`dp4a`) with each weight block's integers, per-block
//   f32 scales (entry points per row count, _r1 .. _r16: NR accumulators).
//   One block of MMVQ_WARPS warps per weight row, four threads per weight
//   block reading its consecutive 32-bit words (see `mmvq` below for the
//   float steps); `kestrel_cuda::reference::mmvq` does this arithmetic in
//   this order on the host.
// * `quantize_q8_h`: f16 rows -> Q8 blocks (the attention output, the final
//   norm's rows) for `mmvq_*`; the norm and SwiGLU kernels quantize fused.
// * `dequant_f16`: rows `row0..row0+nrows` of a weight to f16 (the tile that
//   cuBLAS multiplies for larger batches and prefill), and `embed_gather_q`:
//   embedding rows to the f32 residual stream. Both decode each element
//   exactly as ggml (`kestrel_model::quant::dequantize`), bit for bit.
//
// Type codes are ggml's type ids. Block starts are only 2-byte aligned for
// Q4_0, Q5_0, Q8_0 and Q6_K, so their 32-bit words are read as two 16-bit
// loads (`ld_word`).

#define MMVQ_MAX_ROWS 16
#define MMVQ_WARPS 4

#define GT_F32 0
#define GT_F16 1
#define GT_Q4_0 2
#define GT_Q4_1 3
#define GT_Q5_0 6
#define GT_Q5_1 7
#define GT_Q8_0 8
#define GT_Q4_K 12
#define GT_Q5_K 13
#define GT_Q6_K 14
#define GT_BF16 30

typedef unsigned char u8;

__device__ __forceinline__ u32 ld_u32_a2(const u8* p) {
    const unsigned short* h = (const unsigned short*)p;
    return (u32)h[0] | ((u32)h[1] << 16);
}

__device__ __forceinline__ float ld_h(const u8* p) { return h2f(*(const h16*)p); }

// A 32-bit word of a type-T block: one load where T's blocks keep 4-byte
// alignment (Q4_1, Q5_1, Q4_K, Q5_K: block sizes and field offsets are
// multiples of 4), two 16-bit loads elsewhere.
template <int T>
__device__ __forceinline__ u32 ld_word(const u8* p) {
    if (T == GT_Q4_1 || T == GT_Q5_1 || T == GT_Q4_K || T == GT_Q5_K) return *(const u32*)p;
    return ld_u32_a2(p);
}

__device__ __forceinline__ int dp4a(int a, int b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// Bytes q (each < 128 + off) minus `off`, as signed bytes, without carries.
__device__ __forceinline__ int bytes_minus(u32 q, u32 off) {
    return (int)((q + (128u - off) * 0x01010101u) ^ 0x80808080u);
}

// Bits 0..3 of h to bit 4 of bytes 0..3.
__device__ __forceinline__ u32 spread4(u32 h) {
    return ((h & 1u) << 4) | ((h & 2u) << 11) | ((h & 4u) << 18) | ((h & 8u) << 25);
}

// ggml get_scale_min_k4.
__device__ __forceinline__ void scale_min_k4(int j, const u8* q, int* sc, int* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Block bytes and elements of each type.
__host__ __device__ constexpr int type_block_bytes(int t) {
    return t == GT_Q4_0 ? 18 : t == GT_Q4_1 ? 20 : t == GT_Q5_0 ? 22 : t == GT_Q5_1 ? 24
         : t == GT_Q8_0 ? 34 : t == GT_Q4_K ? 144 : t == GT_Q5_K ? 176 : t == GT_Q6_K ? 210
         : t == GT_F32 ? 4 : 2;
}
__host__ __device__ constexpr int type_block_elems(int t) {
    return (t == GT_Q4_K || t == GT_Q5_K || t == GT_Q6_K) ? 256
         : (t == GT_F32 || t == GT_F16 || t == GT_BF16) ? 1 : 32;
}

// Lane `k` (0..3) of the four threads that share 32-element block `b` of a
// row: its integers for elements 4k..4k+3 (`lo`) and 16+4k..16+4k+3 (`hi`),
// as signed bytes, the block's scales for elements 0..16 and 16..32 (equal
// but for Q6_K) and its minimum (0 when none). The four lanes of a block
// read its consecutive 32-bit words; for the legacy 4-bit and 5-bit types
// one word feeds both nibble halves (lo from its low nibbles, hi from its
// high ones), as llama.cpp's vecdotq does.
struct WPart {
    int lo, hi;
    float d0, d1, m;
};

template <int T>
__device__ __forceinline__ WPart load_part(const u8* __restrict__ row, int b, int k) {
    WPart r;
    r.m = 0.0f;
    if (T == GT_Q4_0 || T == GT_Q4_1 || T == GT_Q5_0 || T == GT_Q5_1) {
        const u8* blk = row + (size_t)b * type_block_bytes(T);
        r.d0 = ld_h(blk);
        int qs_at = T == GT_Q4_0 ? 2 : T == GT_Q4_1 ? 4 : T == GT_Q5_0 ? 6 : 8;
        u32 off = T == GT_Q4_0 ? 8u : T == GT_Q5_0 ? 16u : 0u;
        if (T == GT_Q4_1 || T == GT_Q5_1) r.m = ld_h(blk + 2);
        u32 v = ld_word<T>(blk + qs_at + 4 * k);
        u32 lo = v & 0x0F0F0F0Fu, hi = (v >> 4) & 0x0F0F0F0Fu;
        if (T == GT_Q5_0 || T == GT_Q5_1) {
            u32 qh = ld_word<T>(blk + (T == GT_Q5_0 ? 2 : 4));
            lo |= spread4((qh >> (4 * k)) & 15u);
            hi |= spread4((qh >> (16 + 4 * k)) & 15u);
        }
        r.lo = bytes_minus(lo, off);
        r.hi = bytes_minus(hi, off);
        r.d1 = r.d0;
    } else if (T == GT_Q8_0) {
        const u8* blk = row + (size_t)b * 34;
        r.d0 = r.d1 = ld_h(blk);
        r.lo = (int)ld_word<T>(blk + 2 + 4 * k);
        r.hi = (int)ld_word<T>(blk + 18 + 4 * k);
    } else if (T == GT_Q4_K || T == GT_Q5_K) {
        const u8* sb = row + (size_t)(b >> 3) * type_block_bytes(T);
        int j = b & 7, sc, mn;
        scale_min_k4(j, sb + 4, &sc, &mn);
        r.d0 = r.d1 = __fmul_rn(ld_h(sb), (float)sc);
        r.m = -__fmul_rn(ld_h(sb + 2), (float)mn);
        const u8* qs = sb + (T == GT_Q4_K ? 16 : 48) + 32 * (j >> 1);
        int shift = 4 * (j & 1);
        u32 lo = (ld_word<T>(qs + 4 * k) >> shift) & 0x0F0F0F0Fu;
        u32 hi = (ld_word<T>(qs + 16 + 4 * k) >> shift) & 0x0F0F0F0Fu;
        if (T == GT_Q5_K) {
            lo |= ((ld_word<T>(sb + 16 + 4 * k) >> j) & 0x01010101u) << 4;
            hi |= ((ld_word<T>(sb + 32 + 4 * k) >> j) & 0x01010101u) << 4;
        }
        r.lo = (int)lo;
        r.hi = (int)hi;
    } else {  // GT_Q6_K
        const u8* sb = row + (size_t)(b >> 3) * 210;
        int t = b & 7, n = t >> 2, tt = t & 3;
        const u8* ql = sb + 64 * n + 32 * (tt & 1);
        const u8* qh = sb + 128 + 32 * n;
        const signed char* sc = (const signed char*)(sb + 192 + 8 * n + 2 * tt);
        float d = ld_h(sb + 208);
        r.d0 = __fmul_rn(d, (float)sc[0]);
        r.d1 = __fmul_rn(d, (float)sc[1]);
        int shift = 4 * (tt >> 1), hs = 2 * tt;
        u32 lo = (ld_word<T>(ql + 4 * k) >> shift) & 0x0F0F0F0Fu;
        u32 hi = (ld_word<T>(ql + 16 + 4 * k) >> shift) & 0x0F0F0F0Fu;
        lo |= ((ld_word<T>(qh + 4 * k) >> hs) & 0x03030303u) << 4;
        hi |= ((ld_word<T>(qh + 16 + 4 * k) >> hs) & 0x03030303u) << 4;
        r.lo = bytes_minus(lo, 32u);
        r.hi = bytes_minus(hi, 32u);
    }
    return r;
}

// y[r * ldy + row] = W[row] . x[r] for r < n (<= NR, the accumulators a
// thread keeps: one entry point per NR in 1, 2, 4, 8, 16). One block of
// MMVQ_WARPS warps per weight row: thread t takes lane k = t % 4 of blocks
// t / 4, t / 4 + 32, ... (the loop unrolled by 2 below 16 rows: at 16 the
// unrolled loop spills on sm_90), so a warp reads 8
// neighbouring blocks' words at once and the block's threads 32. Per
// output row a thread adds `fma(float(isum), d_w * d_x, acc)` block by
// block (Q6_K: its lo then its hi sum, each with its half's scale) and,
// lane 0 only, `fma(m_w, s_x, mins)`; then `acc + mins` is summed by a warp
// butterfly and the warps' sums in warp order through shared memory.
// `kestrel_cuda::reference::mmvq` does this arithmetic in this order.
template <int T, int NR>
__device__ __forceinline__ void mmvq(const u8* __restrict__ w, const Q8* __restrict__ xq,
                                     float* __restrict__ y, int rows, int cols, int ldy, int n) {
    const bool has_min = T == GT_Q4_1 || T == GT_Q5_1 || T == GT_Q4_K || T == GT_Q5_K;
    const bool two = T == GT_Q6_K;
    __shared__ float part[NR][MMVQ_WARPS];
    int row = blockIdx.x;
    if (row >= rows) return;  // block-uniform
    int tid = threadIdx.x, k = tid & 3;
    int nb = cols >> 5;
    size_t row_bytes = (size_t)(cols / type_block_elems(T)) * type_block_bytes(T);
    const u8* wr = w + (size_t)row * row_bytes;
    float acc[NR], mins[NR];
#pragma unroll
    for (int r = 0; r < NR; r++) acc[r] = mins[r] = 0.0f;
#pragma unroll (NR < 16 ? 2 : 1)
    for (int b = tid >> 2; b < nb; b += MMVQ_WARPS * 8) {
        WPart wp = load_part<T>(wr, b, k);
#pragma unroll
        for (int r = 0; r < NR; r++) {
            if (r < n) {
                const Q8* xb = xq + (size_t)r * nb + b;
                const int* xi = (const int*)xb->q;
                float dx = xb->d;
                if (two) {
                    int s0 = dp4a(wp.lo, xi[k], 0);
                    int s1 = dp4a(wp.hi, xi[4 + k], 0);
                    acc[r] = __fmaf_rn((float)s0, __fmul_rn(wp.d0, dx), acc[r]);
                    acc[r] = __fmaf_rn((float)s1, __fmul_rn(wp.d1, dx), acc[r]);
                } else {
                    int s = dp4a(wp.hi, xi[4 + k], dp4a(wp.lo, xi[k], 0));
                    acc[r] = __fmaf_rn((float)s, __fmul_rn(wp.d0, dx), acc[r]);
                }
                if (has_min && k == 0) mins[r] = __fmaf_rn(wp.m, xb->s, mins[r]);
            }
        }
    }
    int lane = tid & 31, wi = tid >> 5;
#pragma unroll
    for (int r = 0; r < NR; r++) {
        float v = warp_sum(__fadd_rn(acc[r], mins[r]));
        if (lane == 0) part[r][wi] = v;
    }
    __syncthreads();
    if (tid < NR && tid < n) {
        float v = part[tid][0];
#pragma unroll
        for (int i = 1; i < MMVQ_WARPS; i++) v = __fadd_rn(v, part[tid][i]);
        y[(size_t)tid * ldy + row] = v;
    }
}

// Entry points mmvq_<type>_r<NR>: grid (rows), MMVQ_WARPS * 32 threads, n <=
// NR activation rows (the runtime takes the smallest NR).
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q4_0_r1(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q4_0, 1>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q4_0_r2(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q4_0, 2>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q4_0_r4(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q4_0, 4>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q4_0_r8(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q4_0, 8>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q4_0_r16(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q4_0, 16>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q4_1_r1(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q4_1, 1>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q4_1_r2(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q4_1, 2>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q4_1_r4(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q4_1, 4>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q4_1_r8(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q4_1, 8>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q4_1_r16(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q4_1, 16>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q5_0_r1(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q5_0, 1>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q5_0_r2(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q5_0, 2>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q5_0_r4(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q5_0, 4>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q5_0_r8(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q5_0, 8>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q5_0_r16(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q5_0, 16>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q5_1_r1(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q5_1, 1>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q5_1_r2(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q5_1, 2>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q5_1_r4(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q5_1, 4>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q5_1_r8(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q5_1, 8>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q5_1_r16(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q5_1, 16>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q8_0_r1(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q8_0, 1>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q8_0_r2(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q8_0, 2>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q8_0_r4(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q8_0, 4>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q8_0_r8(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q8_0, 8>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q8_0_r16(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q8_0, 16>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q4_k_r1(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q4_K, 1>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q4_k_r2(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q4_K, 2>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q4_k_r4(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q4_K, 4>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q4_k_r8(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q4_K, 8>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q4_k_r16(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q4_K, 16>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q5_k_r1(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q5_K, 1>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q5_k_r2(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q5_K, 2>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q5_k_r4(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q5_K, 4>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q5_k_r8(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q5_K, 8>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q5_k_r16(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q5_K, 16>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q6_k_r1(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q6_K, 1>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q6_k_r2(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q6_K, 2>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q6_k_r4(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q6_K, 4>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q6_k_r8(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q6_K, 8>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32) mmvq_q6_k_r16(
    const u8* __restrict__ w, const Q8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q6_K, 16>(w, xq, y, rows, cols, ldy, n);
}

// f16 rows (`cols` a multiple of 32) to Q8 blocks. One warp per block;
// grid (ceil(blocks / 8), n), 256 threads.
extern "C" __global__ void quantize_q8_h(const h16* __restrict__ x, Q8* __restrict__ xq,
                                         int cols, int n) {
    int i = blockIdx.y;
    int nb = cols >> 5;
    int b = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (i >= n || b >= nb) return;
    float v = h2f(x[(size_t)i * cols + b * 32 + (threadIdx.x & 31)]);
    warp_quantize(v, xq + (size_t)i * nb + b);
}

// Element `e` of a row in type `t`, exactly as ggml decodes it.
__device__ float dequant_elem(int t, const u8* __restrict__ row, int e) {
    switch (t) {
    case GT_F32: return ((const float*)row)[e];
    case GT_F16: return h2f(((const h16*)row)[e]);
    case GT_BF16: return __uint_as_float((u32)((const h16*)row)[e] << 16);
    case GT_Q8_0: {
        const u8* b = row + (e >> 5) * 34;
        return __fmul_rn(ld_h(b), (float)((const signed char*)b)[2 + (e & 31)]);
    }
    case GT_Q4_0: case GT_Q4_1: case GT_Q5_0: case GT_Q5_1: {
        const u8* b = row + (size_t)(e >> 5) * type_block_bytes(t);
        int l = e & 31;
        int qs_at = t == GT_Q4_0 ? 2 : t == GT_Q4_1 ? 4 : t == GT_Q5_0 ? 6 : 8;
        u8 byte = b[qs_at + (l & 15)];
        int q = l < 16 ? (byte & 15) : (byte >> 4);
        float d = ld_h(b);
        if (t == GT_Q4_0) return __fmul_rn(d, __fsub_rn((float)q, 8.0f));
        if (t == GT_Q4_1) return __fadd_rn(__fmul_rn(d, (float)q), ld_h(b + 2));
        u32 qh = ld_u32_a2(b + (t == GT_Q5_0 ? 2 : 4));
        q |= (int)((qh >> l) & 1u) << 4;
        if (t == GT_Q5_0) return __fmul_rn(d, (float)(q - 16));
        return __fadd_rn(__fmul_rn(d, (float)q), ld_h(b + 2));
    }
    case GT_Q4_K: case GT_Q5_K: {
        const u8* sb = row + (size_t)(e >> 8) * type_block_bytes(t);
        int j = (e >> 5) & 7, l = e & 31, sc, mn;
        scale_min_k4(j, sb + 4, &sc, &mn);
        float d1 = __fmul_rn(ld_h(sb), (float)sc), m1 = __fmul_rn(ld_h(sb + 2), (float)mn);
        int q = (sb[(t == GT_Q4_K ? 16 : 48) + 32 * (j >> 1) + l] >> (4 * (j & 1))) & 15;
        if (t == GT_Q5_K) q |= ((sb[16 + l] >> j) & 1) << 4;
        return __fsub_rn(__fmul_rn(d1, (float)q), m1);
    }
    default: {  // GT_Q6_K
        const u8* sb = row + (size_t)(e >> 8) * 210;
        int w = e & 255, n = w >> 7, tt = (w >> 5) & 3, l = w & 31;
        int q = (sb[64 * n + 32 * (tt & 1) + l] >> (4 * (tt >> 1))) & 15;
        q |= ((sb[128 + 32 * n + l] >> (2 * tt)) & 3) << 4;
        float s = __fmul_rn(ld_h(sb + 208), (float)((const signed char*)sb)[192 + 8 * n + 2 * tt + (l >> 4)]);
        return __fmul_rn(s, (float)(q - 32));
    }
    }
}

// out[(r - row0) * cols + c] = f16(W[r][c]) for r in row0..row0+nrows.
// Grid-stride over the tile; 256 threads.
extern "C" __global__ void dequant_f16(const u8* __restrict__ w, int t, int row0, int nrows,
                                       int cols, h16* __restrict__ out) {
    size_t row_bytes = (size_t)(cols / type_block_elems(t)) * type_block_bytes(t);
    size_t total = (size_t)nrows * cols;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (size_t)gridDim.x * blockDim.x) {
        size_t r = idx / cols;
        int c = (int)(idx % cols);
        out[idx] = f2h(dequant_elem(t, w + (row0 + r) * row_bytes, c));
    }
}

// Token embedding gather from a table in type `t` into the f32 residual
// stream (as `embed_gather`, which it replaces for non-f16 tables). One
// block per row.
extern "C" __global__ void embed_gather_q(const u8* __restrict__ table, int t,
                                          const u32* __restrict__ tokens,
                                          const u32* __restrict__ rows,
                                          float* __restrict__ x, int hidden, int vocab, int n) {
    int i = blockIdx.x;
    if (i >= n) return;
    u32 tok = rows ? tokens[rows[i]] : tokens[i];
    if (tok >= (u32)vocab) tok = 0;  // padding rows and corrupt ids stay in bounds
    size_t row_bytes = (size_t)(hidden / type_block_elems(t)) * type_block_bytes(t);
    const u8* src = table + (size_t)tok * row_bytes;
    float* dst = x + (size_t)i * hidden;
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) dst[j] = dequant_elem(t, src, j);
}
