// shim.h: just enough of CUDA for g++/clang++ to compile a kernels/*.cu file
// on the host, so tests/kernel_source.rs can run a kernel's own source code
// (not a transcription) lane by lane and compare it with the Rust reference.
// Each intrinsic is its IEEE definition (`__fmul_rn` is a rounded product,
// `__fmaf_rn` a fused multiply-add); `dp4a` is the four signed byte products
// summed into c. Warp reductions cannot run with one lane at a time:
// `warp_sum` records each lane's value (the harness then sums them in the
// butterfly's order), and the kernels that reduce across lanes otherwise are
// compiled but not called. Compile with -ffp-contract=off.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#define __device__
#define __global__
#define __forceinline__ inline
#define __host__
#define __restrict__ __restrict

static inline int host_dp4a(int a, int b, int c) {
    for (int e = 0; e < 4; e++)
        c += (int)(signed char)(a >> (8 * e)) * (int)(signed char)(b >> (8 * e));
    return c;
}
// The one inline-PTX statement quant.cu has: `dp4a`'s, whose operands are
// named a, b, c and d.
#define asm(...) d = host_dp4a(a, b, c)

typedef unsigned short h16;
typedef unsigned int u32;
typedef unsigned long long u64;

struct Dim3 {
    int x, y, z;
};
static Dim3 blockIdx, threadIdx, blockDim, gridDim;

// f16 -> f32, exactly (normals, subnormals, inf/NaN).
static inline float h2f(h16 h) {
    u32 sign = (u32)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023;
    u32 bits;
    if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        float v = std::ldexp((float)man, -24);
        return sign ? -v : v;
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}
// Only kernels the harness does not call convert to f16.
static inline h16 f2h(float) { return 0; }

static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
static inline float __uint_as_float(u32 u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// Lane values handed to warp_sum by the lane running now, in call order.
static std::vector<float> g_lane_values;
static inline float warp_sum(float v) {
    g_lane_values.push_back(v);
    return v;
}

struct Q8 {
    float d;
    float s;
    signed char q[32];
};
static inline void warp_quantize(float, Q8*) {}
