// gemma.cu: the element-wise steps Gemma adds to the Llama block, each
// kestrel-cpu's float step for step: the embedding scale (`x *= s` on the
// gathered f32 rows, kestrel-cpu's `forward_rows`) and the final logit
// softcap (`x = cap * tanh(x / cap)`, `block::softcap`; tanhf is the
// device's, within 2 ulp of the CPU's libm). Grid-stride over `len` floats,
// in place.

extern "C" __global__ void scale_f32(float* __restrict__ x, float s, u64 len) {
    for (u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; j < len;
         j += (u64)gridDim.x * blockDim.x)
        x[j] = __fmul_rn(x[j], s);
}

extern "C" __global__ void softcap(float* __restrict__ x, float cap, u64 len) {
    for (u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; j < len;
         j += (u64)gridDim.x * blockDim.x)
        x[j] = __fmul_rn(cap, tanhf(__fdiv_rn(x[j], cap)));
}
