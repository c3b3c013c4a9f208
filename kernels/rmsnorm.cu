// rmsnorm.cu: fused residual add + RMSNorm. `x += delta` (when delta is not
// null) in f32, then `out[o] = x / sqrt(mean(x^2) + eps) * w`: as f16 rows
// for a cuBLAS GEMM (`add_rms_norm`), or quantized per 32-element block to
// int8 for the next matmul's `mmvq_*` kernel (`add_rms_norm_q8`, fused: the
// normalized row never leaves registers). `out_row[i]` redirects or (when
// negative) skips the output of row i (the final norm keeps only the rows
// whose logits are wanted). One block of NORM_THREADS threads per row (as
// llama.cpp's rms_norm for rows of 1024 and more: a decode row's elements
// are read by 1024 threads at once, not 256 looping; issue 75 item 3); the
// sum of squares is a block reduction (`kestrel_cuda::reference::
// add_rms_norm_q8` emulates both on the host).

#define NORM_THREADS 1024

// Adds delta into row i of x and returns 1 / rms of the result (every thread).
__device__ float add_and_inv_rms(float* __restrict__ xr, const float* __restrict__ dr,
                                 int hidden, float eps, float* sh) {
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
    return 1.0f / sqrtf(ss / (float)hidden + eps);
}

extern "C" __global__ void __launch_bounds__(NORM_THREADS) add_rms_norm(float* __restrict__ x,
                                        const float* __restrict__ delta,
                                        const float* __restrict__ w,
                                        h16* __restrict__ out,
                                        const int* __restrict__ out_row,
                                        int hidden, float eps, int n) {
    __shared__ float sh[32];
    int i = blockIdx.x;
    if (i >= n) return;
    float* xr = x + (size_t)i * hidden;
    float inv = add_and_inv_rms(xr, delta ? delta + (size_t)i * hidden : nullptr, hidden, eps, sh);
    int o = out_row ? out_row[i] : i;
    if (o < 0) return;
    h16* orow = out + (size_t)o * hidden;
    for (int j = threadIdx.x; j < hidden; j += blockDim.x)
        orow[j] = f2h(__fmul_rn(__fmul_rn(xr[j], inv), w[j]));
}

// As `add_rms_norm`, the output quantized: row o of `xq` is an activation
// row of hidden / 32 blocks (common.cuh's layout). `hidden` is a multiple
// of 32 and the block a multiple of 32 threads.
extern "C" __global__ void __launch_bounds__(NORM_THREADS) add_rms_norm_q8(float* __restrict__ x,
                                           const float* __restrict__ delta,
                                           const float* __restrict__ w,
                                           u8* __restrict__ xq,
                                           const int* __restrict__ out_row,
                                           int hidden, float eps, int n) {
    __shared__ float sh[32];
    int i = blockIdx.x;
    if (i >= n) return;
    float* xr = x + (size_t)i * hidden;
    float inv = add_and_inv_rms(xr, delta ? delta + (size_t)i * hidden : nullptr, hidden, eps, sh);
    int o = out_row ? out_row[i] : i;
    if (o < 0) return;
    int nb = hidden >> 5, lane = threadIdx.x & 31;
    for (int b = threadIdx.x >> 5; b < nb; b += blockDim.x >> 5) {
        int j = b * 32 + lane;
        warp_quantize(__fmul_rn(__fmul_rn(xr[j], inv), w[j]), xq + (size_t)o * nb * 40, nb, b);
    }
}

// RMSNorm of f32 rows in place, `x = x / sqrt(mean(x^2) + eps) * w` (no
// residual add, no f16): Gemma's post-attention and post-FFN norms, applied
// to a sublayer's output (`delta`) before `add_rms_norm` adds it to the
// residual stream, as kestrel-cpu's `residual_add` with a post-norm. Each
// thread rewrites only the elements it read, after the block sum.
extern "C" __global__ void __launch_bounds__(NORM_THREADS) rms_norm_f32(float* __restrict__ x, const float* __restrict__ w,
                                        int hidden, float eps, int n) {
    __shared__ float sh[32];
    int i = blockIdx.x;
    if (i >= n) return;
    float* xr = x + (size_t)i * hidden;
    float inv = add_and_inv_rms(xr, nullptr, hidden, eps, sh);
    for (int j = threadIdx.x; j < hidden; j += blockDim.x)
        xr[j] = __fmul_rn(__fmul_rn(xr[j], inv), w[j]);
}

// LayerNorm with bias (Phi / Moondream): `x += delta` (when delta is not
// null), then `out[o] = (x - mean) / sqrt(var + eps) * w + b` as f16 rows,
// kestrel-cpu's `ops::layer_norm` formula (the mean first, then the sum of
// squared deviations: two block sums; its sums run in 8 lanes, these in
// NORM_THREADS threads, so values agree to rounding). Every float step is
// explicit, so `kestrel_cuda::reference::add_layer_norm` is this bit for bit.
extern "C" __global__ void __launch_bounds__(NORM_THREADS) add_layer_norm(float* __restrict__ x,
                                          const float* __restrict__ delta,
                                          const float* __restrict__ w,
                                          const float* __restrict__ b,
                                          h16* __restrict__ out,
                                          const int* __restrict__ out_row,
                                          int hidden, float eps, int n) {
    __shared__ float sh[32];
    int i = blockIdx.x;
    if (i >= n) return;
    float* xr = x + (size_t)i * hidden;
    const float* dr = delta ? delta + (size_t)i * hidden : nullptr;
    float s = 0.0f;
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
        float v = xr[j];
        if (dr) {
            v = __fadd_rn(v, dr[j]);
            xr[j] = v;
        }
        s = __fadd_rn(s, v);
    }
    float mean = __fdiv_rn(block_sum(s, sh), (float)hidden);
    float ss = 0.0f;
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
        float d = __fsub_rn(xr[j], mean);
        ss = __fmaf_rn(d, d, ss);
    }
    ss = block_sum(ss, sh);
    float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)hidden), eps)));
    int o = out_row ? out_row[i] : i;
    if (o < 0) return;
    h16* orow = out + (size_t)o * hidden;
    for (int j = threadIdx.x; j < hidden; j += blockDim.x)
        orow[j] = f2h(__fadd_rn(__fmul_rn(__fmul_rn(__fsub_rn(xr[j], mean), inv), w[j]), b[j]));
}
