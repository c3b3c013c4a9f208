// common.cuh: helpers shared by every kernels/*.cu file. Kestrel prepends
// this text to each kernel source before handing it to NVRTC (the sources are
// embedded in the binary, so no include path is needed at run time).
// f16 is carried as `unsigned short` and converted with PTX `cvt`: the
// kernels need no CUDA header at all. Reductions accumulate in f32 (f64 for
// the sampler's probability masses). `kexp` is the CPU runtime's Cephes
// `exp` (crates/kestrel-cpu/src/kernels/ops.rs) so softmax weights match it.

typedef unsigned short h16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define KESTREL_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float h2f(h16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ h16 f2h(float f) {
    h16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// e^x exactly as kestrel-cpu's `ops::exp` (same constants, same fma order).
__device__ __forceinline__ float kexp(float x) {
    const float LOG2E = 1.44269504088896341f;
    const float LN2_HI = 0.693359375f;
    const float LN2_LO = -2.12194440e-4f;
    float xc = fminf(fmaxf(x, -87.3f), 88.7f);
    float n = rintf(xc * LOG2E);
    float r = fmaf(n, -LN2_LO, fmaf(n, -LN2_HI, xc));
    float p = 1.9875691e-4f;
    p = fmaf(p, r, 1.3981999e-3f);
    p = fmaf(p, r, 8.3334520e-3f);
    p = fmaf(p, r, 4.1665796e-2f);
    p = fmaf(p, r, 1.6666665e-1f);
    p = fmaf(p, r, 5.0000001e-1f);
    float y = __fadd_rn(fmaf(__fmul_rn(p, r), r, r), 1.0f);
    float scale = __int_as_float(((int)n + 127) << 23);
    return x < -87.3f ? 0.0f : __fmul_rn(y, scale);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ double warp_sum_f64(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block; every thread gets the result. `sh` holds >= 32 floats.
__device__ float block_sum(float v, float* sh) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    if (lane == 0) sh[w] = v;
    __syncthreads();
    if (w == 0) {
        float t = lane < nw ? sh[lane] : 0.0f;
        t = warp_sum(t);
        if (lane == 0) sh[0] = t;
    }
    __syncthreads();
    float r = sh[0];
    __syncthreads();
    return r;
}

__device__ double block_sum_f64(double v, double* sh) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum_f64(v);
    if (lane == 0) sh[w] = v;
    __syncthreads();
    if (w == 0) {
        double t = lane < nw ? sh[lane] : 0.0;
        t = warp_sum_f64(t);
        if (lane == 0) sh[0] = t;
    }
    __syncthreads();
    double r = sh[0];
    __syncthreads();
    return r;
}

__device__ float block_max(float v, float* sh) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    if (lane == 0) sh[w] = v;
    __syncthreads();
    if (w == 0) {
        float t = lane < nw ? sh[lane] : KESTREL_NEG_INF;
        t = warp_max(t);
        if (lane == 0) sh[0] = t;
    }
    __syncthreads();
    float r = sh[0];
    __syncthreads();
    return r;
}

__device__ u32 block_sum_u32(u32 v, u32* sh) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) sh[w] = v;
    __syncthreads();
    if (w == 0) {
        u32 t = lane < nw ? sh[lane] : 0u;
        for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
        if (lane == 0) sh[0] = t;
    }
    __syncthreads();
    u32 r = sh[0];
    __syncthreads();
    return r;
}

__device__ u32 block_min_u32(u32 v, u32* sh) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) sh[w] = v;
    __syncthreads();
    if (w == 0) {
        u32 t = lane < nw ? sh[lane] : 0xffffffffu;
        for (int o = 16; o > 0; o >>= 1) t = min(t, __shfl_xor_sync(0xffffffffu, t, o));
        if (lane == 0) sh[0] = t;
    }
    __syncthreads();
    u32 r = sh[0];
    __syncthreads();
    return r;
}

typedef unsigned char u8;

// Int8-quantized activation rows, the input of `mmvq_*` (issue 75 item 1;
// `kestrel_cuda::quant::pack_q8_rows` on the host): a row of `nb`
// 32-element blocks takes 40 * nb bytes: its quants (32 * nb bytes), then
// its blocks' scales d (f32, at 32 * nb + 4 * b), then their sums s (f32,
// at 36 * nb + 4 * b): element i of block b is q * d, and s = d * sum(q)
// (kestrel-cpu's fast-numerics `Q8Block`, whose values these are). The
// quants are in `mmvq`'s load order: blocks in pairs (2p, 2p + 1), 64
// bytes at 64 * p, where the block's thread k (0..3) finds its 16 bytes at
// 16 * k: block 2p's elements 4k..4k+3 and 16+4k..16+4k+3, then block
// 2p+1's, so the thread reads both blocks' integers in one 16-byte load
// (a warp's lanes consecutive 16 bytes) and both scales in one 8-byte
// load. A last unpaired block (odd nb) takes 32 bytes at 32 * b, thread
// k's 8 bytes at 8 * k.
__host__ __device__ __forceinline__ int q8_pos(int nb, int b, int e) {
    int k = (e & 15) >> 2, in = ((e >> 4) << 2) | (e & 3);  // thread, byte of its 8
    bool paired = (b | 1) < nb;
    return (b >> 1) * 64 + (paired ? 16 * k + 8 * (b & 1) : 8 * k) + in;
}

// Quantize this lane's value v (element `lane` of block b; the whole warp
// calls it) into the row `row` of nb blocks: d = max|v| / 127,
// q = rint(v * (1 / d)), s = d * sum(q): kestrel-cpu's
// `int8::quantize_row`, step by step.
__device__ __forceinline__ void warp_quantize(float v, u8* row, int nb, int b) {
    int lane = threadIdx.x & 31;
    float amax = warp_max(fabsf(v));
    float d = __fdiv_rn(amax, 127.0f);
    float id = d == 0.0f ? 0.0f : __fdiv_rn(1.0f, d);
    int q = __float2int_rn(__fmul_rn(v, id));
    int sum = q;
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    row[q8_pos(nb, b, lane)] = (u8)(signed char)q;
    if (lane == 0) {
        ((float*)(row + 32 * (size_t)nb))[b] = d;
        ((float*)(row + 36 * (size_t)nb))[b] = __fmul_rn(d, (float)sum);
    }
}
