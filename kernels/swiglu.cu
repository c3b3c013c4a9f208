// swiglu.cu: `out = silu(gate) * up` over the fused gate|up GEMM output
// (f32 rows of 2*f: gate in [0, f), up in [f, 2f)), written as f16 for the
// down projection. Same formula and exp as kestrel-cpu: g / (1 + e^-g) * u.

extern "C" __global__ void swiglu(const float* __restrict__ gate_up, h16* __restrict__ out,
                                  int f, int n) {
    size_t total = (size_t)n * f;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (size_t)gridDim.x * blockDim.x) {
        size_t i = idx / f, j = idx % f;
        float g = gate_up[i * 2 * f + j];
        float u = gate_up[i * 2 * f + f + j];
        out[idx] = f2h(__fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, kexp(-g))), u));
    }
}
