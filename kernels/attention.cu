// attention.cu: decode attention split over keys (flash-decoding, issue 75
// item 2) over the kestrel-kv page layout (FlashInfer-style kv_indptr /
// kv_indices). Query row i belongs to sequence row_seq[i] at position
// row_pos[i] and attends keys first..=row_pos[i] (causal; with `window` > 0
// only the last `window` positions, as kestrel-cpu's `attend_window`).
//
// Two launches:
// - `paged_attention`, grid (num_kv_heads * head blocks, rows, max_splits),
//   ATT_THREADS threads: a block takes one KV head, up to ATT_HB query heads
//   of its GQA group (all of them when the group is <= ATT_HB), and one key
//   range of the row: the row's keys cut into at most `max_splits` ranges of
//   a multiple of ATT_SPLIT_QUANTUM keys (at least ATT_SPLIT_MIN), so short
//   contexts take one range and long ones spread over many blocks; blocks
//   past the row's last range return. Each K and V row is read once for
//   every query head of the block, in 16-byte loads where head_dim allows:
//   a key takes `seg` lanes (8 dimensions each; seg a power of two), a warp
//   32 / seg keys at once. Every key slot keeps an online softmax per head
//   (f32), the block merges its slots through shared memory in slot order
//   and writes the range's (max, sum, unnormalized output) to `part`.
// - `paged_attention_merge`, grid (num_heads, rows): combines the row's
//   ranges in order into the f16 output.
// Every float step is an explicit __f*_rn / fmaf, so the result equals
// `kestrel_cuda::reference::decode_attention` bit for bit (checked on the
// host, tests/kernel_source.rs).

#define ATT_THREADS 128
#define ATT_WARPS (ATT_THREADS / 32)
#define ATT_HB 4              // query heads of a GQA group per block
#define ATT_VEC 8             // dimensions per lane (one 16-byte load)
#define ATT_SPLIT_MIN 64      // fewest keys of a range
#define ATT_SPLIT_QUANTUM 32  // a range's keys are a multiple of this
#define ATT_MAX_SLOTS (ATT_THREADS)
#define ATT_SH_ACC (ATT_THREADS * ATT_VEC)  // slots x head_dim <= this

// The keys of row i: first..len, cut into ranges of `per` keys (the last
// shorter); returns the number of ranges.
__device__ __forceinline__ int att_ranges(int first, int len, int max_splits, int* per) {
    int keys = len - first;
    int p = (keys + max_splits - 1) / max_splits;
    p = (p + ATT_SPLIT_QUANTUM - 1) / ATT_SPLIT_QUANTUM * ATT_SPLIT_QUANTUM;
    if (p < ATT_SPLIT_MIN) p = ATT_SPLIT_MIN;
    *per = p;
    return (keys + p - 1) / p;
}

// Eight f16 values of a K or V row from `d0`, 0 past head_dim; one 16-byte
// load when the row allows it.
__device__ __forceinline__ void att_load8(const h16* __restrict__ row, int d0, int head_dim,
                                          bool vec, float* out) {
    if (vec && d0 < head_dim) {
        uint4 u = *(const uint4*)(row + d0);
        u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            out[2 * e] = h2f((h16)(w[e] & 0xffffu));
            out[2 * e + 1] = h2f((h16)(w[e] >> 16));
        }
    } else {
#pragma unroll
        for (int e = 0; e < ATT_VEC; ++e) out[e] = d0 + e < head_dim ? h2f(row[d0 + e]) : 0.0f;
    }
}

extern "C" __global__ void __launch_bounds__(ATT_THREADS) paged_attention(
    const float* __restrict__ qkv, int stride, const h16* __restrict__ k_cache,
    const h16* __restrict__ v_cache, const u32* __restrict__ row_seq,
    const u32* __restrict__ row_pos, const u32* __restrict__ kv_indptr,
    const u32* __restrict__ kv_indices, int num_heads, int num_kv_heads, int head_dim,
    int page_size, float scale, int window, int n, int max_splits, float* __restrict__ part) {
    __shared__ float sh_m[ATT_MAX_SLOTS * ATT_HB];
    __shared__ float sh_l[ATT_MAX_SLOTS * ATT_HB];
    __shared__ float sh_acc[ATT_HB * ATT_SH_ACC];
    const int group = num_heads / num_kv_heads;
    const int hblocks = (group + ATT_HB - 1) / ATT_HB;
    const int g = blockIdx.x / hblocks, h0 = g * group + (blockIdx.x % hblocks) * ATT_HB;
    const int nh = min(ATT_HB, g * group + group - h0);
    const int i = blockIdx.y, split = blockIdx.z;
    if (i >= n) return;
    const int len = (int)row_pos[i] + 1;
    const int first = (window > 0 && len > window) ? len - window : 0;
    int per;
    const int ranges = att_ranges(first, len, max_splits, &per);
    if (split >= ranges) return;
    const int k0 = first + split * per, k1 = min(len, k0 + per);

    // Lanes per key (a power of two covering head_dim / 8), keys per warp.
    const int lanes = (head_dim + ATT_VEC - 1) / ATT_VEC;
    int seg = 1;
    while (seg < lanes) seg <<= 1;
    const int kpw = 32 / seg, slots = ATT_WARPS * kpw;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int sub = lane & (seg - 1), slot = warp * kpw + lane / seg;
    const int d0 = sub * ATT_VEC;
    const bool vec = (head_dim & (ATT_VEC - 1)) == 0;
    const int kv_dim = num_kv_heads * head_dim;
    const u32* pages = kv_indices + kv_indptr[row_seq[i]];

    float q[ATT_HB][ATT_VEC], acc[ATT_HB][ATT_VEC], m[ATT_HB], l[ATT_HB];
#pragma unroll
    for (int t = 0; t < ATT_HB; ++t) {
        const float* qh = qkv + (size_t)i * stride + (size_t)(h0 + min(t, nh - 1)) * head_dim;
#pragma unroll
        for (int e = 0; e < ATT_VEC; ++e) {
            q[t][e] = d0 + e < head_dim ? qh[d0 + e] : 0.0f;
            acc[t][e] = 0.0f;
        }
        m[t] = KESTREL_NEG_INF;
        l[t] = 0.0f;
    }
    // Warp-uniform trip count: every lane meets every shuffle.
    for (int base = k0 + warp * kpw; base < k1; base += slots) {
        const int j = base + lane / seg;
        const bool valid = j < k1;
        const int jj = valid ? j : base;
        const size_t off =
            ((size_t)pages[jj / page_size] * page_size + (jj % page_size)) * kv_dim +
            (size_t)g * head_dim;
        float kv[ATT_VEC];
        att_load8(k_cache + off, d0, head_dim, vec, kv);
        float sc[ATT_HB];
#pragma unroll
        for (int t = 0; t < ATT_HB; ++t) {
            float dot = 0.0f;
#pragma unroll
            for (int e = 0; e < ATT_VEC; ++e) dot = fmaf(q[t][e], kv[e], dot);
            for (int o = seg >> 1; o > 0; o >>= 1)
                dot = __fadd_rn(dot, __shfl_xor_sync(0xffffffffu, dot, o));
            sc[t] = __fmul_rn(dot, scale);
        }
        att_load8(v_cache + off, d0, head_dim, vec, kv);
        if (valid) {
#pragma unroll
            for (int t = 0; t < ATT_HB; ++t) {
                float mn = fmaxf(m[t], sc[t]);
                float corr = kexp(__fsub_rn(m[t], mn));
                float p = kexp(__fsub_rn(sc[t], mn));
                l[t] = fmaf(l[t], corr, p);
#pragma unroll
                for (int e = 0; e < ATT_VEC; ++e) acc[t][e] = fmaf(p, kv[e], __fmul_rn(acc[t][e], corr));
                m[t] = mn;
            }
        }
    }
    // The block's slots, merged in slot order.
    for (int t = 0; t < nh; ++t) {
        if (sub == 0) {
            sh_m[t * ATT_MAX_SLOTS + slot] = m[t];
            sh_l[t * ATT_MAX_SLOTS + slot] = l[t];
        }
#pragma unroll
        for (int e = 0; e < ATT_VEC; ++e)
            if (d0 + e < head_dim) sh_acc[t * ATT_SH_ACC + slot * head_dim + d0 + e] = acc[t][e];
    }
    __syncthreads();
    const int stride_part = head_dim + 2;
    for (int x = threadIdx.x; x < nh * head_dim; x += blockDim.x) {
        const int t = x / head_dim, d = x % head_dim;
        const float* ms = sh_m + t * ATT_MAX_SLOTS;
        const float* ls = sh_l + t * ATT_MAX_SLOTS;
        float M = KESTREL_NEG_INF;
        for (int s = 0; s < slots; ++s)
            if (ls[s] > 0.0f) M = fmaxf(M, ms[s]);
        float L = 0.0f, A = 0.0f;
        for (int s = 0; s < slots; ++s) {
            if (ls[s] > 0.0f) {
                float c = kexp(__fsub_rn(ms[s], M));
                L = fmaf(ls[s], c, L);
                A = fmaf(c, sh_acc[t * ATT_SH_ACC + s * head_dim + d], A);
            }
        }
        float* o = part + (((size_t)i * num_heads + h0 + t) * max_splits + split) * stride_part;
        if (d == 0) {
            o[0] = M;
            o[1] = L;
        }
        o[2 + d] = A;
    }
}

// The row's ranges of `paged_attention`, combined in order; grid
// (num_heads, rows), threads over head_dim.
extern "C" __global__ void __launch_bounds__(ATT_THREADS) paged_attention_merge(
    const float* __restrict__ part, const u32* __restrict__ row_pos, h16* __restrict__ out,
    int num_heads, int head_dim, int window, int n, int max_splits) {
    const int h = blockIdx.x, i = blockIdx.y;
    if (i >= n || h >= num_heads) return;
    const int len = (int)row_pos[i] + 1;
    const int first = (window > 0 && len > window) ? len - window : 0;
    int per;
    const int ranges = att_ranges(first, len, max_splits, &per);
    const int stride_part = head_dim + 2;
    const float* p = part + ((size_t)i * num_heads + h) * max_splits * stride_part;
    float M = KESTREL_NEG_INF;
    for (int s = 0; s < ranges; ++s) M = fmaxf(M, p[s * stride_part]);
    float L = 0.0f;
    for (int s = 0; s < ranges; ++s)
        L = fmaf(p[s * stride_part + 1], kexp(__fsub_rn(p[s * stride_part], M)), L);
    const float inv = L > 0.0f ? __fdiv_rn(1.0f, L) : 0.0f;
    h16* o = out + ((size_t)i * num_heads + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float v = 0.0f;
        for (int s = 0; s < ranges; ++s)
            v = fmaf(kexp(__fsub_rn(p[s * stride_part], M)), p[s * stride_part + 2 + d], v);
        o[d] = f2h(__fmul_rn(v, inv));
    }
}
