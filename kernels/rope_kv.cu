// rope_kv.cu: rotary embeddings on the Q and K heads of the fused QKV output
// (f32, row stride `stride`, Q | K | V), fused with the append of the row's
// K and V to the paged f16 cache of one layer: rotated Q stays in `qkv` for
// paged attention, rotated K and V go only to the cache, laid out
// `[page][slot in page][kv_head][head_dim]` like kestrel-cpu's KvStore, at
// `slot_mapping[i] = page * page_size + pos % page_size` (padding rows of a
// CUDA-graph bucket map to the trash page past the last real page).
// With `q_norm`/`k_norm` (Qwen3, Gemma 3) each head is first RMS-normed
// with its weight (`head_dim` floats), as kestrel-cpu's `ops::rms_norm`
// before its `ops::rope`: one warp per head sums the squares (lane j takes
// elements j, j + 32, ...; a butterfly sum), then each lane normalizes and
// rotates its pairs. The cos/sin table is built on the host as kestrel-cpu's
// `RopeSpec::table`, `[pos][cos_0..cos_{d/2}, sin_0..sin_{d/2}]` (one table
// per distinct layer RoPE). Conventions (kestrel_model::RopeStyle):
// interleaved = pairs (2i, 2i+1) (GGUF/llama.cpp), half-split = pairs
// (i, i + d/2) (HF rotate_half). Products are rounded separately (no fma),
// so the rotation is kestrel-cpu's `ops::rope` bit for bit. Grid (rows,
// head blocks): block (i, y) takes heads y * warps + warp, stepping by
// gridDim.y * warps (one warp per head; blockDim a multiple of 32), and its
// share of the row's V; the heads of a row run in parallel over blocks
// (issue 75 item 3), each head's arithmetic unchanged. `rotary_dim` <
// `head_dim` (Phi's partial rotary) rotates the first `rotary_dim`
// dimensions of each head only (its table rows are `rotary_dim` wide,
// pairs within them) and passes the rest through (normed when the head is),
// as kestrel-cpu's `block::rope_partial`.

extern "C" __global__ void rope_kv_append(float* __restrict__ qkv, int stride,
                                          int num_q_heads, int num_k_heads, int head_dim,
                                          int rotary_dim, const float* __restrict__ table,
                                          const u32* __restrict__ pos, int interleaved,
                                          const float* __restrict__ q_norm,
                                          const float* __restrict__ k_norm, float eps,
                                          h16* __restrict__ k_cache, h16* __restrict__ v_cache,
                                          const u32* __restrict__ slot_mapping, int n) {
    int i = blockIdx.x;
    if (i >= n) return;
    int half = rotary_dim >> 1;
    int kv_dim = num_k_heads * head_dim;
    int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    int step = (int)gridDim.y * nw;
    const float* t = table + (size_t)pos[i] * rotary_dim;
    float* row = qkv + (size_t)i * stride;
    size_t dst = (size_t)slot_mapping[i] * kv_dim;
    // Q heads first, then K heads right after them (column q_dim).
    for (int head = (int)blockIdx.y * nw + (threadIdx.x >> 5); head < num_q_heads + num_k_heads;
         head += step) {
        float* hp = row + (size_t)head * head_dim;
        const float* w = head < num_q_heads ? q_norm : k_norm;
        float inv = 1.0f;
        if (w) {
            float ss = 0.0f;
            for (int j = lane; j < head_dim; j += 32) ss = __fmaf_rn(hp[j], hp[j], ss);
            // A shuffle: every lane has read its elements before any writes.
            ss = warp_sum(ss);
            inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)head_dim), eps)));
        }
        for (int k = lane; k < half; k += 32) {
            int a = interleaved ? 2 * k : k;
            int b = interleaved ? 2 * k + 1 : k + half;
            float c = t[k], s = t[half + k];
            float x0 = hp[a], x1 = hp[b];
            if (w) {
                x0 = __fmul_rn(__fmul_rn(x0, inv), w[a]);
                x1 = __fmul_rn(__fmul_rn(x1, inv), w[b]);
            }
            float y0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
            float y1 = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
            if (head < num_q_heads) {
                hp[a] = y0;
                hp[b] = y1;
            } else {
                h16* kc = k_cache + dst + (size_t)(head - num_q_heads) * head_dim;
                kc[a] = f2h(y0);
                kc[b] = f2h(y1);
            }
        }
        // The dimensions past the rotated ones (partial rotary only).
        for (int j = rotary_dim + lane; j < head_dim; j += 32) {
            float v = hp[j];
            if (w) v = __fmul_rn(__fmul_rn(v, inv), w[j]);
            if (head < num_q_heads)
                hp[j] = v;
            else
                k_cache[dst + (size_t)(head - num_q_heads) * head_dim + j] = f2h(v);
        }
    }
    const float* v = row + (size_t)(num_q_heads + num_k_heads) * head_dim;
    for (int j = (int)(blockIdx.y * blockDim.x + threadIdx.x); j < kv_dim;
         j += (int)(gridDim.y * blockDim.x))
        v_cache[dst + j] = f2h(v[j]);
}
