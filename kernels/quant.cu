// quant.cu: weights read in their GGUF encoding (no f16 copy on the device).
//
// * `mmvq_<type>`: decode matmul for 1..MMVQ_MAX_ROWS activation rows, as
//   llama.cpp's MMVQ: activations quantized once per 32-element block to
//   int8 with their scale and block sum (the values of kestrel-cpu's
//   fast-numerics `Q8Block`, laid out as common.cuh's activation rows:
//   quants in load order, then the scales), integer dot products (`dp4a`)
//   with each weight block's integers, per-block f32 scales (entry points
//   per row count, _r1 .. _r16: NR accumulators). One block of MMVQ_WARPS
//   warps per weight row, four threads per weight block reading its
//   consecutive 32-bit words, two blocks at a time (see `mmvq` below for
//   the loads and the float steps); `kestrel_cuda::reference::mmvq` does
//   this arithmetic in this order on the host.
// * `quantize_q8_h`: f16 rows -> activation rows (the attention output, the
//   final norm's rows) for `mmvq_*`; the norm and SwiGLU kernels quantize
//   fused.
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

// Lane k's parts of blocks 2p and 2p + 1 of a row (`load_part` of each).
// For Q4_K and Q5_K the pair is one 64-element sub-block pair of a
// super-block, whose quant bytes hold block 2p in their low nibbles and
// 2p + 1 in their high ones (and whose Q5_K high-bit bytes hold both):
// each word is loaded once and feeds both blocks.
template <int T>
__device__ __forceinline__ void load_pair(const u8* __restrict__ row, int p, WPart& a, WPart& b,
                                          int k) {
    if (T == GT_Q4_K || T == GT_Q5_K) {
        const u8* sb = row + (size_t)(p >> 2) * type_block_bytes(T);
        int j = (2 * p) & 7, sc, mn;
        float d = ld_h(sb), dmin = ld_h(sb + 2);
        scale_min_k4(j, sb + 4, &sc, &mn);
        a.d0 = a.d1 = __fmul_rn(d, (float)sc);
        a.m = -__fmul_rn(dmin, (float)mn);
        scale_min_k4(j + 1, sb + 4, &sc, &mn);
        b.d0 = b.d1 = __fmul_rn(d, (float)sc);
        b.m = -__fmul_rn(dmin, (float)mn);
        const u8* qs = sb + (T == GT_Q4_K ? 16 : 48) + 32 * (j >> 1);
        u32 lo = ld_word<T>(qs + 4 * k), hi = ld_word<T>(qs + 16 + 4 * k);
        u32 alo = lo & 0x0F0F0F0Fu, ahi = hi & 0x0F0F0F0Fu;
        u32 blo = (lo >> 4) & 0x0F0F0F0Fu, bhi = (hi >> 4) & 0x0F0F0F0Fu;
        if (T == GT_Q5_K) {
            u32 hlo = ld_word<T>(sb + 16 + 4 * k), hhi = ld_word<T>(sb + 32 + 4 * k);
            alo |= ((hlo >> j) & 0x01010101u) << 4;
            ahi |= ((hhi >> j) & 0x01010101u) << 4;
            blo |= ((hlo >> (j + 1)) & 0x01010101u) << 4;
            bhi |= ((hhi >> (j + 1)) & 0x01010101u) << 4;
        }
        a.lo = (int)alo, a.hi = (int)ahi, b.lo = (int)blo, b.hi = (int)bhi;
    } else {
        a = load_part<T>(row, 2 * p, k);
        b = load_part<T>(row, 2 * p + 1, k);
    }
}

// One weight block's share of thread k against activation integers xlo,
// xhi (elements 4k..4k+3, 16+4k..16+4k+3) with the activation block's
// scale dx and sum sx, into the thread's running sums (Q6_K: its lo then
// its hi sum, each with its half's scale; mins on lane 0 of a block only).
template <int T>
__device__ __forceinline__ void mmvq_dot(const WPart& wp, int xlo, int xhi, float dx, float sx,
                                         int k, float& acc, float& mins) {
    const bool has_min = T == GT_Q4_1 || T == GT_Q5_1 || T == GT_Q4_K || T == GT_Q5_K;
    if (T == GT_Q6_K) {
        int s0 = dp4a(wp.lo, xlo, 0);
        int s1 = dp4a(wp.hi, xhi, 0);
        acc = __fmaf_rn((float)s0, __fmul_rn(wp.d0, dx), acc);
        acc = __fmaf_rn((float)s1, __fmul_rn(wp.d1, dx), acc);
    } else {
        int s = dp4a(wp.hi, xhi, dp4a(wp.lo, xlo, 0));
        acc = __fmaf_rn((float)s, __fmul_rn(wp.d0, dx), acc);
    }
    if (has_min && k == 0) mins = __fmaf_rn(wp.m, sx, mins);
}

// One activation row's share of pair p for thread k: the integers (x, y:
// block 2p's lo and hi words; z, w: block 2p + 1's) from `q16`, both
// blocks' scales from `d8` and, where the type has minimums, their sums
// from `s8`: 16- and 8-byte loads (V16: the row's pairs 16-byte aligned),
// else 8- and 4-byte ones.
template <int T, bool V16>
__device__ __forceinline__ void x_pair(const u8* __restrict__ q16, const u8* __restrict__ d8,
                                       const u8* __restrict__ s8, uint4& q, float2& d,
                                       float2& s) {
    const bool has_min = T == GT_Q4_1 || T == GT_Q5_1 || T == GT_Q4_K || T == GT_Q5_K;
    if (V16) {
        q = *(const uint4*)q16;
        d = *(const float2*)d8;
        if (has_min) s = *(const float2*)s8;
    } else {
        uint2 a = *(const uint2*)q16, b = *(const uint2*)(q16 + 8);
        q.x = a.x, q.y = a.y, q.z = b.x, q.w = b.y;
        d.x = ((const float*)d8)[0], d.y = ((const float*)d8)[1];
        if (has_min) s.x = ((const float*)s8)[0], s.y = ((const float*)s8)[1];
    }
}

// This thread's share of one weight row (`wr`) against n activation rows:
// its block pairs in order, then the unpaired last block if it is its, into
// acc[r] and mins[r] (see `mmvq`).
template <int T, int NR, bool V16>
__device__ __forceinline__ void mmvq_rows(const u8* __restrict__ wr, const u8* __restrict__ xq,
                                          int nb, int n, float* acc, float* mins) {
    int tid = threadIdx.x, k = tid & 3, np = nb >> 1;
    size_t x_bytes = (size_t)nb * 40;
#pragma unroll 1
    for (int p = tid >> 2; p < np; p += MMVQ_WARPS * 8) {
        WPart w0, w1;
        load_pair<T>(wr, p, w0, w1, k);
        const u8* xp = xq + 64 * p + 16 * k;  // row r's integers of the pair,
        const u8* dp = xq + 32 * nb + 8 * p;   // their scales
        const u8* sp = xq + 36 * nb + 8 * p;   // and sums
#pragma unroll
        for (int r = 0; r < NR; r++, xp += x_bytes, dp += x_bytes, sp += x_bytes) {
            if (r < n) {
                uint4 q;
                float2 d, sx = {0.0f, 0.0f};
                x_pair<T, V16>(xp, dp, sp, q, d, sx);
                mmvq_dot<T>(w0, (int)q.x, (int)q.y, d.x, sx.x, k, acc[r], mins[r]);
                mmvq_dot<T>(w1, (int)q.z, (int)q.w, d.y, sx.y, k, acc[r], mins[r]);
            }
        }
    }
    if ((nb & 1) && (tid >> 2) == np % (MMVQ_WARPS * 8)) {  // the unpaired last block
        int b = nb - 1;
        WPart wb = load_part<T>(wr, b, k);
#pragma unroll
        for (int r = 0; r < NR; r++) {
            if (r < n) {
                const u8* xr = xq + r * x_bytes;
                uint2 q = *(const uint2*)(xr + 32 * b + 8 * k);
                float d = ((const float*)(xr + 32 * nb))[b];
                float sx = ((const float*)(xr + 36 * nb))[b];
                mmvq_dot<T>(wb, (int)q.x, (int)q.y, d, sx, k, acc[r], mins[r]);
            }
        }
    }
}

// y[r * ldy + row] = W[row] . x[r] for r < n (<= NR, the accumulators a
// thread keeps: one entry point per NR in 1, 2, 4, 8, 16). `xq` holds n
// activation rows of nb = cols / 32 blocks, 40 * nb bytes each, in
// common.cuh's layout (quants in load order, then the scales, then the
// sums), 8-byte aligned. One block of MMVQ_WARPS warps per weight row:
// thread t takes lane k = t % 4 of the block pairs (2p, 2p + 1) for
// p = t / 4, t / 4 + 32, ... (the block loop unrolled by 2: both blocks'
// weight words are loaded, then per activation row the pair's 16 bytes of
// integers in one load, both scales in one 8-byte load and, for the types
// with minimums, both sums in another, when every row's pairs are 16-byte
// aligned: nb even and xq 16-byte aligned; 8- and 4-byte loads
// otherwise), and a last unpaired block (odd nb) after its thread's
// pairs. A warp reads 16 neighbouring weight blocks' words and 512
// consecutive activation bytes of a row at once; a K-type pair is one
// 64-element sub-block pair, whose two halves' nibbles share their words.
// Per output row a thread adds `fma(float(isum), d_w * d_x, acc)` block by
// block in block order (`mmvq_dot`) and, lane 0 only,
// `fma(m_w, s_x, mins)`; then `acc + mins` is summed by a warp butterfly
// and the warps' sums in warp order through shared memory.
// `kestrel_cuda::reference::mmvq` does this arithmetic in this order.
// `__launch_bounds__(.., 1)`: without a minimum of blocks NVRTC 13's ptxas
// spilled 4-20 bytes in two of the 40 entry points at 40-56 registers.
template <int T, int NR>
__device__ __forceinline__ void mmvq(const u8* __restrict__ w, const u8* __restrict__ xq,
                                     float* __restrict__ y, int rows, int cols, int ldy, int n) {
    __shared__ float part[NR][MMVQ_WARPS];
    int row = blockIdx.x;
    if (row >= rows) return;  // block-uniform
    int tid = threadIdx.x, nb = cols >> 5;
    size_t row_bytes = (size_t)(cols / type_block_elems(T)) * type_block_bytes(T);
    const u8* wr = w + (size_t)row * row_bytes;
    float acc[NR], mins[NR];
#pragma unroll
    for (int r = 0; r < NR; r++) acc[r] = mins[r] = 0.0f;
    // Grid-uniform: 16-byte activation loads where every row allows them.
    if ((nb & 1) == 0 && ((size_t)xq & 15) == 0)
        mmvq_rows<T, NR, true>(wr, xq, nb, n, acc, mins);
    else
        mmvq_rows<T, NR, false>(wr, xq, nb, n, acc, mins);
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
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q4_0_r1(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q4_0, 1>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q4_0_r2(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q4_0, 2>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q4_0_r4(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q4_0, 4>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q4_0_r8(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q4_0, 8>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q4_0_r16(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q4_0, 16>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q4_1_r1(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q4_1, 1>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q4_1_r2(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q4_1, 2>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q4_1_r4(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q4_1, 4>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q4_1_r8(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q4_1, 8>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q4_1_r16(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q4_1, 16>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q5_0_r1(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q5_0, 1>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q5_0_r2(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q5_0, 2>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q5_0_r4(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q5_0, 4>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q5_0_r8(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q5_0, 8>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q5_0_r16(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q5_0, 16>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q5_1_r1(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q5_1, 1>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q5_1_r2(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q5_1, 2>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q5_1_r4(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q5_1, 4>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q5_1_r8(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q5_1, 8>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q5_1_r16(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q5_1, 16>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q8_0_r1(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q8_0, 1>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q8_0_r2(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q8_0, 2>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q8_0_r4(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q8_0, 4>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q8_0_r8(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q8_0, 8>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q8_0_r16(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q8_0, 16>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q4_k_r1(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q4_K, 1>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q4_k_r2(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q4_K, 2>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q4_k_r4(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q4_K, 4>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q4_k_r8(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q4_K, 8>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q4_k_r16(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q4_K, 16>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q5_k_r1(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q5_K, 1>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q5_k_r2(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q5_K, 2>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q5_k_r4(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q5_K, 4>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q5_k_r8(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q5_K, 8>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q5_k_r16(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q5_K, 16>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q6_k_r1(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q6_K, 1>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q6_k_r2(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q6_K, 2>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q6_k_r4(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q6_K, 4>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q6_k_r8(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q6_K, 8>(w, xq, y, rows, cols, ldy, n);
}
extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 1) mmvq_q6_k_r16(
    const u8* __restrict__ w, const u8* __restrict__ xq, float* __restrict__ y, int rows,
    int cols, int ldy, int n) {
    mmvq<GT_Q6_K, 16>(w, xq, y, rows, cols, ldy, n);
}

// f16 rows (`cols` a multiple of 32) to activation rows (common.cuh). One warp per block;
// grid (ceil(blocks / 8), n), 256 threads.
extern "C" __global__ void quantize_q8_h(const h16* __restrict__ x, u8* __restrict__ xq,
                                         int cols, int n) {
    int i = blockIdx.y;
    int nb = cols >> 5;
    int b = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (i >= n || b >= nb) return;
    float v = h2f(x[(size_t)i * cols + b * 32 + (threadIdx.x & 31)]);
    warp_quantize(v, xq + (size_t)i * nb * 40, nb, b);
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
