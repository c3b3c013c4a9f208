// rmsnorm.cu: fused residual add + RMSNorm. `x += delta` (when delta is not
// null) in f32, then `out[o] = x / sqrt(mean(x^2) + eps) * w` in f16 for the
// GEMM that follows. `out_row[i]` redirects or (when negative) skips the
// normalized output of row i (the final norm keeps only the rows whose logits
// are wanted). One block per row; the sum of squares is a block reduction.

extern "C" __global__ void add_rms_norm(float* __restrict__ x,
                                        const float* __restrict__ delta,
                                        const float* __restrict__ w,
                                        h16* __restrict__ out,
                                        const int* __restrict__ out_row,
                                        int hidden, float eps, int n) {
    __shared__ float sh[32];
    int i = blockIdx.x;
    if (i >= n) return;
    float* xr = x + (size_t)i * hidden;
    const float* dr = delta ? delta + (size_t)i * hidden : nullptr;
    float ss = 0.0f;
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
        float v = xr[j];
        if (dr) {
            v = __fadd_rn(v, dr[j]);
            xr[j] = v;
        }
        ss = fmaf(v, v, ss);
    }
    ss = block_sum(ss, sh);
    int o = out_row ? out_row[i] : i;
    if (o < 0) return;
    float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
    h16* orow = out + (size_t)o * hidden;
    for (int j = threadIdx.x; j < hidden; j += blockDim.x)
        orow[j] = f2h(__fmul_rn(__fmul_rn(xr[j], inv), w[j]));
}
