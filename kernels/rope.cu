// rope.cu: the QKV bias, added to the fused QKV matmul output (f32, row
// stride `stride`) before `rope_kv_append` (rope_kv.cu) rotates Q and K.

extern "C" __global__ void add_bias(float* __restrict__ y, const float* __restrict__ b,
                                    int stride, int d, int n) {
    int i = blockIdx.x;
    if (i >= n) return;
    for (int j = threadIdx.x; j < d; j += blockDim.x)
        y[(size_t)i * stride + j] = __fadd_rn(y[(size_t)i * stride + j], b[j]);
}
