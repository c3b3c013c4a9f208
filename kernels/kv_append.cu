// kv_append.cu: write each row's new K and V (f32 GEMM output, RoPE applied
// to K) into the paged f16 cache of one layer. The cache is laid out
// `[page][slot in page][kv_head][head_dim]` like kestrel-cpu's KvStore;
// `slot_mapping[i] = page * page_size + pos % page_size` is packed on the host
// from the kestrel-kv page table. Padding rows of a CUDA-graph bucket map to
// the trash page past the last real page. One block per row.

extern "C" __global__ void kv_append(const float* __restrict__ qkv, int stride,
                                     int k_off, int v_off,
                                     h16* __restrict__ k_cache, h16* __restrict__ v_cache,
                                     const u32* __restrict__ slot_mapping,
                                     int kv_dim, int n) {
    int i = blockIdx.x;
    if (i >= n) return;
    size_t dst = (size_t)slot_mapping[i] * kv_dim;
    const float* row = qkv + (size_t)i * stride;
    for (int j = threadIdx.x; j < kv_dim; j += blockDim.x) {
        k_cache[dst + j] = f2h(row[k_off + j]);
        v_cache[dst + j] = f2h(row[v_off + j]);
    }
}
