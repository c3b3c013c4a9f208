// rope.cu: rotary embeddings on the Q and K parts of the fused QKV GEMM
// output (f32, row stride `stride`), plus the QKV bias. The cos/sin table is
// built once on the host exactly as kestrel-cpu's `ops::rope_table` (f64,
// rounded once), laid out `[pos][cos_0..cos_{d/2}, sin_0..sin_{d/2}]`.
// Conventions (kestrel_model::RopeStyle): interleaved = pairs (2i, 2i+1)
// (GGUF/llama.cpp), half-split = pairs (i, i + d/2) (HF rotate_half).
// Products are rounded separately (no fma) to match the CPU bit for bit.

extern "C" __global__ void add_bias(float* __restrict__ y, const float* __restrict__ b,
                                    int stride, int d, int n) {
    int i = blockIdx.x;
    if (i >= n) return;
    for (int j = threadIdx.x; j < d; j += blockDim.x)
        y[(size_t)i * stride + j] = __fadd_rn(y[(size_t)i * stride + j], b[j]);
}

extern "C" __global__ void rope_qk(float* __restrict__ qkv, int stride,
                                   int num_q_heads, int num_k_heads, int head_dim,
                                   const float* __restrict__ table,
                                   const u32* __restrict__ pos,
                                   int interleaved, int n) {
    int i = blockIdx.x;
    if (i >= n) return;
    int half = head_dim >> 1;
    const float* t = table + (size_t)pos[i] * head_dim;
    float* row = qkv + (size_t)i * stride;
    int pairs = (num_q_heads + num_k_heads) * half;
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        int head = p / half, k = p % half;
        // Q heads first, then K heads right after them (column q_dim).
        float* hp = row + (size_t)head * head_dim;
        int a = interleaved ? 2 * k : k;
        int b = interleaved ? 2 * k + 1 : k + half;
        float c = t[k], s = t[half + k];
        float x0 = hp[a], x1 = hp[b];
        hp[a] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
        hp[b] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
    }
}
