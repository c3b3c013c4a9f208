// swiglu.cu: `out = silu(gate) * up` over the fused gate|up matmul output
// (f32 rows of 2*f: gate in [0, f), up in [f, 2f)), written as f16 for a
// cuBLAS down projection (`swiglu`) or quantized per 32-element block to
// int8 for the down projection's `mmvq_*` kernel (`swiglu_q8`, fused). Same
// formula and exp as kestrel-cpu: g / (1 + e^-g) * u. `gelu_mul` /
// `gelu_mul_q8` are the same with Gemma's GELU-tanh (one body each,
// `gated_f16` / `gated_q8`, templated on the activation). `bias_gelu` is
// an ungated FFN's activation (Phi's `fc1`, Moondream's region decoders):
// `out = gelu_tanh(y + b)` as f16, kestrel-cpu's `block::bias_gelu_tanh`.

__device__ __forceinline__ float silu_mul(float g, float u) {
    return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, kexp(-g))), u);
}

// GELU (tanh approximation) instead of SiLU, Gemma's `gelu_pytorch_tanh`:
// `0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) * u`, the float steps of
// kestrel-cpu's `block::gelu_tanh_mul` in its order (tanhf is the device's,
// within 2 ulp of the CPU's libm tanh).
__device__ __forceinline__ float gelu_tanh(float g) {
    float cube = __fmul_rn(__fmul_rn(__fmul_rn(0.044715f, g), g), g);
    float inner = __fmul_rn(0.7978846f, __fadd_rn(g, cube));
    return __fmul_rn(__fmul_rn(0.5f, g), __fadd_rn(1.0f, tanhf(inner)));
}

__device__ __forceinline__ float gelu_tanh_mul(float g, float u) {
    return __fmul_rn(gelu_tanh(g), u);
}

// The gated activation `act(gate, up)` of every row, written as f16: a
// grid-stride loop over n*f.
template <float (*act)(float, float)>
__device__ __forceinline__ void gated_f16(const float* __restrict__ gate_up,
                                          h16* __restrict__ out, int f, int n) {
    size_t total = (size_t)n * f;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (size_t)gridDim.x * blockDim.x) {
        size_t i = idx / f, j = idx % f;
        out[idx] = f2h(act(gate_up[i * 2 * f + j], gate_up[i * 2 * f + f + j]));
    }
}

// The same quantized per 32-element block: one warp per block, grid
// (ceil(f / 32 / 8), n), 256 threads; `f` a multiple of 32. Row i of `xq`
// is an activation row of f / 32 blocks (common.cuh's layout).
template <float (*act)(float, float)>
__device__ __forceinline__ void gated_q8(const float* __restrict__ gate_up, u8* __restrict__ xq,
                                         int f, int n) {
    int i = blockIdx.y;
    int nb = f >> 5;
    int b = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (i >= n || b >= nb) return;
    size_t j = (size_t)b * 32 + (threadIdx.x & 31);
    const float* row = gate_up + (size_t)i * 2 * f;
    warp_quantize(act(row[j], row[f + j]), xq + (size_t)i * nb * 40, nb, b);
}

extern "C" __global__ void swiglu(const float* __restrict__ gate_up, h16* __restrict__ out,
                                  int f, int n) {
    gated_f16<silu_mul>(gate_up, out, f, n);
}

extern "C" __global__ void swiglu_q8(const float* __restrict__ gate_up, u8* __restrict__ xq,
                                     int f, int n) {
    gated_q8<silu_mul>(gate_up, xq, f, n);
}

extern "C" __global__ void gelu_mul(const float* __restrict__ gate_up, h16* __restrict__ out,
                                    int f, int n) {
    gated_f16<gelu_tanh_mul>(gate_up, out, f, n);
}

extern "C" __global__ void gelu_mul_q8(const float* __restrict__ gate_up, u8* __restrict__ xq,
                                       int f, int n) {
    gated_q8<gelu_tanh_mul>(gate_up, xq, f, n);
}

// `out[i, j] = gelu_tanh(y[i, j] + b[j])` (f16; b null: no bias) for rows of
// `f` floats, grid-stride over n*f.
extern "C" __global__ void bias_gelu(const float* __restrict__ y, const float* __restrict__ b,
                                     h16* __restrict__ out, int f, int n) {
    size_t total = (size_t)n * f;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (size_t)gridDim.x * blockDim.x) {
        float v = y[idx];
        if (b) v = __fadd_rn(v, b[idx % f]);
        out[idx] = f2h(gelu_tanh(v));
    }
}
