// embedding.cu: token embedding gather into the f32 residual stream.
// Decode reads each row's input token from the device-resident `pending`
// array (indexed by KV row), so sampled tokens never travel through the host;
// prefill passes the prompt tokens directly (`rows == nullptr`).
// One block per row; cost O(hidden) per row.

extern "C" __global__ void embed_gather(const h16* __restrict__ table,
                                        const u32* __restrict__ tokens,
                                        const u32* __restrict__ rows,
                                        float* __restrict__ x,
                                        int hidden, int vocab, int n) {
    int i = blockIdx.x;
    if (i >= n) return;
    u32 t = rows ? tokens[rows[i]] : tokens[i];
    if (t >= (u32)vocab) t = 0;  // padding rows and corrupt ids stay in bounds
    const h16* src = table + (size_t)t * hidden;
    float* dst = x + (size_t)i * hidden;
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) dst[j] = h2f(src[j]);
}
