// rope.cu: the QKV bias, added to the fused QKV matmul output (f32, row
// stride `stride`) before `rope_kv_append` (rope_kv.cu) rotates Q and K
// (also the output biases of Phi's projections and LM head); and
// `add_f32`, a residual add without a norm (`x += y`, Phi's parallel block
// adds its attention output before its FFN output, kestrel-cpu's order).

extern "C" __global__ void add_bias(float* __restrict__ y, const float* __restrict__ b,
                                    int stride, int d, int n) {
    int i = blockIdx.x;
    if (i >= n) return;
    for (int j = threadIdx.x; j < d; j += blockDim.x)
        y[(size_t)i * stride + j] = __fadd_rn(y[(size_t)i * stride + j], b[j]);
}

extern "C" __global__ void add_f32(float* __restrict__ x, const float* __restrict__ y, u64 len) {
    for (u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; j < len;
         j += (u64)gridDim.x * blockDim.x)
        x[j] = __fadd_rn(x[j], y[j]);
}
