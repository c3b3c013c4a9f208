// attention.cu: paged attention with grouped-query heads over the kestrel-kv
// page layout (FlashInfer-style kv_indptr / kv_indices). Query row i belongs
// to sequence row_seq[i] at position row_pos[i] and attends keys
// 0..=row_pos[i] (causal), so the same kernel serves decode (one row per
// sequence) and prefill chunks (one row per prompt token), as on the CPU.
// Grid (num_heads, rows), 4 warps per block: each warp streams a strided
// subset of keys with an online softmax in f32, then the warps merge.
// Cost O(len * head_dim) per (row, head); K/V read as f16, output f16.
// Sliding window (Mistral, Gemma 3's local layers; issue 32 item 4): with
// `window` > 0 a row attends only keys len - window .. len - 1 (the last
// `window` positions, itself included), as kestrel-cpu's `attend_window`.

#define ATT_MAX_E 8      // head_dim <= 256
#define ATT_MAX_WARPS 4  // blockDim.x <= 128

extern "C" __global__ void __launch_bounds__(ATT_MAX_WARPS * 32) paged_attention(const float* __restrict__ qkv, int stride,
                                           h16* __restrict__ out,
                                           const h16* __restrict__ k_cache,
                                           const h16* __restrict__ v_cache,
                                           const u32* __restrict__ row_seq,
                                           const u32* __restrict__ row_pos,
                                           const u32* __restrict__ kv_indptr,
                                           const u32* __restrict__ kv_indices,
                                           int num_heads, int num_kv_heads, int head_dim,
                                           int page_size, float scale, int window, int n) {
    __shared__ float sh_m[ATT_MAX_WARPS];
    __shared__ float sh_l[ATT_MAX_WARPS];
    __shared__ float sh_acc[ATT_MAX_WARPS * ATT_MAX_E * 32];
    int h = blockIdx.x, i = blockIdx.y;
    if (i >= n || h >= num_heads) return;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int g = h / (num_heads / num_kv_heads);
    int kv_dim = num_kv_heads * head_dim;
    int E = (head_dim + 31) >> 5;
    const float* q = qkv + (size_t)i * stride + (size_t)h * head_dim;
    float qv[ATT_MAX_E], acc[ATT_MAX_E];
#pragma unroll
    for (int e = 0; e < ATT_MAX_E; ++e) {
        int d = lane + 32 * e;
        qv[e] = (e < E && d < head_dim) ? q[d] : 0.0f;
        acc[e] = 0.0f;
    }
    u32 s = row_seq[i];
    int len = (int)row_pos[i] + 1;
    const u32* pages = kv_indices + kv_indptr[s];
    float m = KESTREL_NEG_INF, l = 0.0f;
    // Sliding window: the first key this row sees (0: the whole prefix).
    int first = (window > 0 && len > window) ? len - window : 0;
    for (int j = first + warp; j < len; j += nw) {
        u32 page = pages[j / page_size];
        size_t off = ((size_t)page * page_size + (j % page_size)) * kv_dim + (size_t)g * head_dim;
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < ATT_MAX_E; ++e) {
            int d = lane + 32 * e;
            if (e < E && d < head_dim) dot = fmaf(qv[e], h2f(k_cache[off + d]), dot);
        }
        float sc = warp_sum(dot) * scale;
        float mn = fmaxf(m, sc);
        float corr = kexp(m - mn);
        float p = kexp(sc - mn);
        l = l * corr + p;
#pragma unroll
        for (int e = 0; e < ATT_MAX_E; ++e) {
            int d = lane + 32 * e;
            if (e < E && d < head_dim) acc[e] = fmaf(p, h2f(v_cache[off + d]), acc[e] * corr);
        }
        m = mn;
    }
    if (lane == 0) {
        sh_m[warp] = m;
        sh_l[warp] = l;
    }
#pragma unroll
    for (int e = 0; e < ATT_MAX_E; ++e) {
        int d = lane + 32 * e;
        if (e < E && d < head_dim) sh_acc[warp * head_dim + d] = acc[e];
    }
    __syncthreads();
    if (warp != 0) return;
    float M = KESTREL_NEG_INF;
    for (int w = 0; w < nw; ++w) M = fmaxf(M, sh_m[w]);
    float L = 0.0f;
    for (int w = 0; w < nw; ++w)
        if (sh_l[w] > 0.0f) L += sh_l[w] * kexp(sh_m[w] - M);
    float inv = L > 0.0f ? 1.0f / L : 0.0f;
    h16* o = out + (size_t)i * num_heads * head_dim + (size_t)h * head_dim;
    for (int e = 0; e < E; ++e) {
        int d = lane + 32 * e;
        if (d >= head_dim) continue;
        float v = 0.0f;
        for (int w = 0; w < nw; ++w)
            if (sh_l[w] > 0.0f) v = fmaf(kexp(sh_m[w] - M), sh_acc[w * head_dim + d], v);
        o[d] = f2h(v * inv);
    }
}
