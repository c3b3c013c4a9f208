// prefill_attention.cu: tiled causal attention for several query rows per
// sequence (prefill chunks, re-prefill after preemption), GQA, over the
// kestrel-kv page layout (kv_indptr / kv_indices), as paged_attention's
// arguments plus a sliding window. Query row i belongs to sequence
// row_seq[i] at position row_pos[i] and attends keys lo_i..=row_pos[i]
// (lo_i = 0, or row_pos[i] + 1 - window when window > 0 and it is
// positive), so a chunk starting at q_start > 0 reads the cached prefix
// pages without recomputing them.
//
// Grid (num_heads, ceil(n / PF_Q_ROWS)), PF_WARPS warps. A block takes
// PF_Q_ROWS consecutive rows of one head and, for each run of them that
// shares a sequence, streams that sequence's keys in tiles of PF_KEYS
// through shared memory (K rows padded by one word: lane j reads key j
// without bank conflicts), each tile read once for all the run's rows.
// Lane j scores key j; an online softmax (f32, kexp) keeps each row's max,
// sum and output (lane owns dims lane + 32 e). Every float step is an
// explicit __f*_rn, so the order is the host reference's
// (crate::reference::prefill_attention), bit for bit. Cost per (row, head):
// O(len * head_dim) flops; K/V traffic per tile is shared by PF_Q_ROWS rows.

#define PF_Q_ROWS 8
#define PF_KEYS 32
#define PF_WARPS 4
#define PF_MAX_HD 256
#define PF_MAX_E 8   // PF_MAX_HD / 32
#define PF_QPW 2     // PF_Q_ROWS / PF_WARPS: rows per warp

__device__ __forceinline__ int pf_lo(u32 pos, int window) {
    int len = (int)pos + 1;
    return (window > 0 && len > window) ? len - window : 0;
}

extern "C" __global__ void __launch_bounds__(PF_WARPS * 32) prefill_attention(
    const float* __restrict__ qkv, int stride, h16* __restrict__ out,
    const h16* __restrict__ k_cache, const h16* __restrict__ v_cache,
    const u32* __restrict__ row_seq, const u32* __restrict__ row_pos,
    const u32* __restrict__ kv_indptr, const u32* __restrict__ kv_indices,
    int num_heads, int num_kv_heads, int head_dim, int page_size, float scale, int window,
    int n) {
    __shared__ float sh_q[PF_Q_ROWS * PF_MAX_HD];
    __shared__ h16 sh_k[PF_KEYS * (PF_MAX_HD + 2)];
    __shared__ h16 sh_v[PF_KEYS * PF_MAX_HD];
    int h = blockIdx.x, r0 = blockIdx.y * PF_Q_ROWS;
    if (h >= num_heads || r0 >= n) return;
    int rows = n - r0 < PF_Q_ROWS ? n - r0 : PF_Q_ROWS;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int g = h / (num_heads / num_kv_heads);
    int kv_dim = num_kv_heads * head_dim, kstride = head_dim + 2;
    for (int t = threadIdx.x; t < rows * head_dim; t += blockDim.x) {
        int r = t / head_dim, d = t % head_dim;
        sh_q[t] = qkv[(size_t)(r0 + r) * stride + (size_t)h * head_dim + d];
    }
    // Runs [a, b) of rows sharing a sequence (uniform over the block).
    for (int a = 0; a < rows;) {
        u32 s = row_seq[r0 + a];
        int b = a + 1;
        while (b < rows && row_seq[r0 + b] == s) ++b;
        int hi = 0, lo = 0x7fffffff;
        for (int r = a; r < b; ++r) {
            u32 p = row_pos[r0 + r];
            hi = (int)p + 1 > hi ? (int)p + 1 : hi;
            int l = pf_lo(p, window);
            lo = l < lo ? l : lo;
        }
        const u32* pages = kv_indices + kv_indptr[s];
        float m[PF_QPW], l[PF_QPW], acc[PF_QPW][PF_MAX_E];
#pragma unroll
        for (int qq = 0; qq < PF_QPW; ++qq) {
            m[qq] = KESTREL_NEG_INF;
            l[qq] = 0.0f;
#pragma unroll
            for (int e = 0; e < PF_MAX_E; ++e) acc[qq][e] = 0.0f;
        }
        for (int k0 = lo / PF_KEYS * PF_KEYS; k0 < hi; k0 += PF_KEYS) {
            // Keys k0 + [ja, jb) are in some row's range: load only those.
            int ja = lo > k0 ? lo - k0 : 0;
            int jb = hi - k0 < PF_KEYS ? hi - k0 : PF_KEYS;
            __syncthreads();  // the previous tile (and sh_q's fill) is done
            for (int t = threadIdx.x; t < (jb - ja) * head_dim; t += blockDim.x) {
                int j = ja + t / head_dim, d = t % head_dim, key = k0 + j;
                u32 page = pages[key / page_size];
                size_t off = ((size_t)page * page_size + (key % page_size)) * kv_dim +
                             (size_t)g * head_dim + d;
                sh_k[j * kstride + d] = k_cache[off];
                sh_v[j * head_dim + d] = v_cache[off];
            }
            __syncthreads();
#pragma unroll
            for (int qq = 0; qq < PF_QPW; ++qq) {
                int r = warp + PF_WARPS * qq;
                if (r < a || r >= b) continue;  // warp-uniform
                u32 p = row_pos[r0 + r];
                int rlo = pf_lo(p, window) - k0, rhi = (int)p + 1 - k0;
                int va = rlo > 0 ? rlo : 0, vb = rhi < PF_KEYS ? rhi : PF_KEYS;
                if (va >= vb) continue;  // no key of this tile is visible
                float sc = KESTREL_NEG_INF;
                if (lane >= va && lane < vb) {
                    const float* q = sh_q + r * head_dim;
                    const h16* kr = sh_k + lane * kstride;
                    float dot = 0.0f;
                    for (int d = 0; d < head_dim; ++d) dot = __fmaf_rn(q[d], h2f(kr[d]), dot);
                    sc = __fmul_rn(dot, scale);
                }
                float mn = fmaxf(m[qq], warp_max(sc));
                float corr = kexp(__fsub_rn(m[qq], mn));
                float pj = (lane >= va && lane < vb) ? kexp(__fsub_rn(sc, mn)) : 0.0f;
                l[qq] = __fmaf_rn(l[qq], corr, warp_sum(pj));
#pragma unroll
                for (int e = 0; e < PF_MAX_E; ++e) acc[qq][e] = __fmul_rn(acc[qq][e], corr);
                for (int j = va; j < vb; ++j) {
                    float pb = __shfl_sync(0xffffffffu, pj, j);
                    const h16* vr = sh_v + j * head_dim;
#pragma unroll
                    for (int e = 0; e < PF_MAX_E; ++e) {
                        int d = lane + 32 * e;
                        if (d < head_dim) acc[qq][e] = __fmaf_rn(pb, h2f(vr[d]), acc[qq][e]);
                    }
                }
                m[qq] = mn;
            }
        }
#pragma unroll
        for (int qq = 0; qq < PF_QPW; ++qq) {
            int r = warp + PF_WARPS * qq;
            if (r < a || r >= b) continue;
            float inv = l[qq] > 0.0f ? __fdiv_rn(1.0f, l[qq]) : 0.0f;
            h16* o = out + (size_t)(r0 + r) * num_heads * head_dim + (size_t)h * head_dim;
#pragma unroll
            for (int e = 0; e < PF_MAX_E; ++e) {
                int d = lane + 32 * e;
                if (d < head_dim) o[d] = f2h(__fmul_rn(acc[qq][e], inv));
            }
        }
        a = b;
    }
}
