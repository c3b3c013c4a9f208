// shim.h: just enough of CUDA for a C++20 host compiler to build kernels/*.cu
// (with common.cuh) and run them, so tests/kernel_source.rs can execute a
// kernel's own source code, not a transcription, and compare it with its
// Rust reference bit for bit.
//
// Execution model: the harness runs a launch's blocks one after another, each
// block's threads as real std::threads. `__syncthreads` is a barrier over the
// block; `__shfl_xor_sync` a two-phase exchange over the warp (every lane
// writes its value, waits, reads its partner's, waits), so warp and block
// reductions run as on a GPU, for kernels whose returns are warp-uniform
// (as every Kestrel kernel's are). `__shared__` arrays are function statics
// (blocks never overlap). Each intrinsic is its IEEE definition; the test
// rewrites the sources' three inline-PTX statements (f16 conversions, dp4a)
// into the host_* functions below. Compile with -ffp-contract=off.
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#define __device__
#define __global__
#define __forceinline__ inline
#define __host__
#define __restrict__ __restrict
#define __shared__ static
#define __launch_bounds__(...)

struct Dim3 {
    int x, y, z;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(8) float2 {
    float x, y;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
static Dim3 blockIdx, blockDim, gridDim;
static thread_local Dim3 threadIdx;

static inline float host_h2f(unsigned short h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023;
    if (exp == 0) {
        float v = std::ldexp((float)man, -24);
        return sign ? -v : v;
    }
    uint32_t bits = exp == 31 ? sign | 0x7f800000u | (man << 13)
                              : sign | ((exp + 112) << 23) | (man << 13);
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// f32 -> f16, round to nearest even (PTX cvt.rn.f16.f32).
static inline unsigned short host_f2h(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (unsigned short)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0));
    if (ax >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // rounds past 65504
    if (ax < 0x38800000u) {  // f16 subnormal or zero: units of 2^-24
        float v = std::nearbyint(std::ldexp(std::fabs(f), 24));
        return (unsigned short)(sign | (uint32_t)v);
    }
    uint32_t man = ax & 0x7fffffu, exp = (ax >> 23) - 112;
    uint32_t h = (exp << 10) | (man >> 13), rest = man & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1))) h++;
    return (unsigned short)(sign | h);
}

// CUDA's integer min (common.cuh's block_min_u32).
static inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }

static inline int host_dp4a(int a, int b, int c) {
    for (int e = 0; e < 4; e++)
        c += (int)(signed char)(a >> (8 * e)) * (int)(signed char)(b >> (8 * e));
    return c;
}

static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fsqrt_rn(float a) { return std::sqrt(a); }
static inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
static inline int __float2int_rn(float f) { return (int)std::nearbyint(f); }
static inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
static inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
static inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

struct Warp {
    std::barrier<> bar{32};
    uint64_t slot[32];
};
static std::vector<std::unique_ptr<Warp>> g_warps;
static std::unique_ptr<std::barrier<>> g_block;

static inline void __syncthreads() { g_block->arrive_and_wait(); }

template <class T>
static inline T __shfl_xor_sync(unsigned, T v, int o) {
    Warp& w = *g_warps[threadIdx.x / 32];
    int lane = threadIdx.x & 31;
    std::memcpy(&w.slot[lane], &v, sizeof v);
    w.bar.arrive_and_wait();
    T r;
    std::memcpy(&r, &w.slot[lane ^ o], sizeof r);
    w.bar.arrive_and_wait();
    return r;
}

// Global-memory atomics: the threads of a block are real threads.
static inline unsigned atomicAdd(unsigned* p, unsigned v) {
    return std::atomic_ref<unsigned>(*p).fetch_add(v);
}

// Lane `src`'s value to every lane (the same two-phase exchange).
template <class T>
static inline T __shfl_sync(unsigned, T v, int src) {
    Warp& w = *g_warps[threadIdx.x / 32];
    int lane = threadIdx.x & 31;
    std::memcpy(&w.slot[lane], &v, sizeof v);
    w.bar.arrive_and_wait();
    T r;
    std::memcpy(&r, &w.slot[src & 31], sizeof r);
    w.bar.arrive_and_wait();
    return r;
}

// Run `kernel` over `grid` blocks of `threads` threads (a multiple of 32).
static inline void launch(Dim3 grid, int threads, const std::function<void()>& kernel) {
    gridDim = grid;
    blockDim = {threads, 1, 1};
    for (int bz = 0; bz < (grid.z > 0 ? grid.z : 1); bz++) {
    for (int by = 0; by < grid.y; by++) {
        for (int bx = 0; bx < grid.x; bx++) {
            blockIdx = {bx, by, bz};
            g_block = std::make_unique<std::barrier<>>(threads);
            g_warps.clear();
            for (int w = 0; w < threads / 32; w++) g_warps.push_back(std::make_unique<Warp>());
            std::vector<std::thread> ts;
            for (int t = 0; t < threads; t++) {
                ts.emplace_back([t, &kernel] {
                    threadIdx = {t, 0, 0};
                    kernel();
                });
            }
            for (auto& t : ts) t.join();
        }
    }
    }
}
