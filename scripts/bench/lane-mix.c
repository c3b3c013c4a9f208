// The Q4_K lane sweep's instruction mix on one core, with parts of it
// taken out: what bounds `x86_lanes::q4_k_vnni512` (R = 4 rows, G = 2
// sixteen-lane groups, the 32-stream decode's sweep) and what a change of
// design would buy. Not the engine's code: a replica of its loop, the same
// per 32-element block as the kernel (8 four-byte steps; per step two
// 64-byte activation loads, per row the four weight bytes broadcast and
// masked, two `vpdpbusd`; per block and row-group pair the fast numerics'
// float step: `acc = fma(float(isum), d_w * d_x, acc)`, `mins = fma(m,
// sum(x), mins)`), activations 64 KiB (in L2, as for a 2048-column row).
//
//   gcc -O3 -march=native scripts/bench/lane-mix.c -o /tmp/lane-mix && /tmp/lane-mix
//
// Prints `vpdpbusd` per second for each variant (best of three passes)
// and the core's clock: against it, how many of the two a cycle it can issue are
// used. The variants:
//   today        the kernel's mix
//   no-float     no float step (integer sums only)
//   per-256      an integer scale multiply per block (vpmulld + vpaddd) in
//                place of the float step: a per-256 activation scale's
//                K-quant sweep
//   permuted     weights loaded 32 bytes a row and block, each step's four
//                bytes taken by `vpermd` (no memory broadcast), float step
//   permuted-256 both: permuted weights, integer scale multiply
//   no-float-permuted, registers-only: the ceilings without the float step
//   split        each row's nibbles one to a byte in memory (as split once
//                per super-block into L1), each step's four bytes broadcast
//                by `vpbroadcastd` from there, no mask; float step
//
// Every variant holds its activations in registers and "today" takes its
// broadcast and mask as the kernel's code does, one `vpandd` with a
// broadcast memory operand (inline asm). Left to itself gcc folded the
// activations into each `vpdpbusd` as memory operands (a load per row where
// the kernel loads once per step) and broadcast the weights from a general
// register; that replica (before 2026-12-03) ran "today" 10-20% slower a
// cycle than this one and so overstated what the broadcasts cost (a
// "split" beside it read 20-30% over its "today"; here 3-5%, and in the
// kernel level: docs/bench/cpu-1b.md, "The lane sweep's masks").

#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#define R 4
#define G 2
enum { TODAY, NO_FLOAT, PER_256, PERMUTED, PERMUTED_256, NO_FLOAT_PERMUTED, REGISTERS_ONLY, SPLIT, VARIANTS };
static const char *names[VARIANTS] = {"today", "no-float", "per-256", "permuted", "permuted-256",
                                      "no-float-permuted", "registers-only", "split"};

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static inline __attribute__((always_inline)) float sweep(const uint8_t *w, const int8_t *x,
                                                         const float *dm, const float *dx,
                                                         int blocks, int v) {
    __m512 acc[R][G], mins[R][G];
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) acc[r][g] = mins[r][g] = _mm512_setzero_ps();
    const __m512i mask = _mm512_set1_epi8(0x0f);
    __m512i kidx[8];
    for (int k = 0; k < 8; k++) kidx[k] = _mm512_set1_epi32(k);
    const int permuted = v == PERMUTED || v == PERMUTED_256 || v == NO_FLOAT_PERMUTED;
    for (int b = 0; b < blocks; b++) {
        const int bb = b & 63;
        __m512i s[R][G], wrow[R];
        for (int r = 0; r < R; r++) {
            for (int g = 0; g < G; g++) s[r][g] = _mm512_setzero_si512();
            if (permuted)
                wrow[r] = _mm512_castsi256_si512(
                    _mm256_loadu_si256((const __m256i *)(w + (size_t)r * 4096 + (size_t)(b & 255) * 16)));
        }
        for (int k = 0; k < 8; k++) {
            __m512i xk[G];
            for (int g = 0; g < G; g++) xk[g] = _mm512_loadu_si512(x + g * 32768 + 512 * bb + 64 * k);
            // Activations stay in registers (gcc would fold them into each
            // `vpdpbusd` as memory operands, a load per row; the kernel
            // loads them once per step).
            for (int g = 0; g < G; g++) __asm__("" : "+v"(xk[g]));
            for (int r = 0; r < R; r++) {
                __m512i wk;
                if (v == SPLIT)
                    wk = _mm512_set1_epi32(*(const int32_t *)(w + (size_t)r * 8192 + (size_t)(b & 255) * 32 + 4 * k));
                else if (v == REGISTERS_ONLY)
                    wk = _mm512_add_epi32(mask, _mm512_set1_epi32(r + k));
                else if (permuted)
                    wk = _mm512_and_si512(_mm512_permutexvar_epi32(kidx[k], wrow[r]), mask);
                else
                    __asm__("vpandd %1%{1to16%}, %2, %0"
                            : "=v"(wk)
                            : "m"(*(const int32_t *)(w + (size_t)r * 4096 + (size_t)(b & 255) * 16 + 4 * k)),
                              "v"(mask));
                for (int g = 0; g < G; g++) s[r][g] = _mm512_dpbusd_epi32(s[r][g], wk, xk[g]);
            }
        }
        if (v == TODAY || v == PERMUTED || v == SPLIT) {
            for (int g = 0; g < G; g++) {
                const __m512 d = _mm512_loadu_ps(dx + 16 * bb + 1024 * g);
                const __m512 sx = _mm512_loadu_ps(dx + 16 * bb + 1024 * g + 512);
                for (int r = 0; r < R; r++) {
                    const __m512 dd = _mm512_mul_ps(_mm512_set1_ps(dm[16 * (b & 7) + r]), d);
                    acc[r][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][g]), dd, acc[r][g]);
                    mins[r][g] = _mm512_fmadd_ps(_mm512_set1_ps(dm[16 * (b & 7) + 8 + r]), sx, mins[r][g]);
                }
            }
        } else if (v == PER_256 || v == PERMUTED_256) {
            for (int r = 0; r < R; r++) {
                const __m512i sc = _mm512_set1_epi32(((const int32_t *)dm)[16 * (b & 7) + r] & 63);
                for (int g = 0; g < G; g++)
                    acc[r][g] = _mm512_castsi512_ps(
                        _mm512_add_epi32(_mm512_castps_si512(acc[r][g]), _mm512_mullo_epi32(s[r][g], sc)));
            }
        } else {
            for (int r = 0; r < R; r++)
                for (int g = 0; g < G; g++)
                    acc[r][g] = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(acc[r][g]), s[r][g]));
        }
    }
    float t = 0;
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) t += _mm512_reduce_add_ps(_mm512_add_ps(acc[r][g], mins[r][g]));
    return t;
}

// One function per variant, so each is allocated registers on its own.
#define VARIANT(v)                                                                              \
    __attribute__((noinline)) static float sweep_##v(const uint8_t *w, const int8_t *x,         \
                                                     const float *dm, const float *dx, int n) { \
        return sweep(w, x, dm, dx, n, v);                                                       \
    }
VARIANT(0) VARIANT(1) VARIANT(2) VARIANT(3) VARIANT(4) VARIANT(5) VARIANT(6) VARIANT(7)
static float (*const sweeps[VARIANTS])(const uint8_t *, const int8_t *, const float *, const float *, int) = {
    sweep_0, sweep_1, sweep_2, sweep_3, sweep_4, sweep_5, sweep_6, sweep_7};

// The core's clock, from a chain of dependent adds (one a cycle).
static double clock_ghz(void) {
    long x = 0;
    const long n = 200000000;
    const double t0 = now();
    for (long i = 0; i < n; i++)
        __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\t"
                         "add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0"
                         : "+r"(x));
    return 8.0 * n / (now() - t0) / 1e9;
}

int main(void) {
    static uint8_t w[R * 8192 + 4096];
    static int8_t x[65536];
    static float dm[256], dx[4096];
    for (int i = 0; i < (int)sizeof w; i++) w[i] = (uint8_t)(i * 7);
    for (int i = 0; i < 65536; i++) x[i] = (int8_t)(i * 3);
    for (int i = 0; i < 256; i++) dm[i] = 1.0f / (i + 1);
    for (int i = 0; i < 4096; i++) dx[i] = 0.001f * i;
    const int blocks = 256;
    const long reps = 20000;
    for (int v = 0; v < VARIANTS; v++) {
        double best = 0;
        float sink = 0;
        for (int pass = 0; pass < 3; pass++) {
            const double t0 = now();
            for (long i = 0; i < reps; i++) {
                sink += sweeps[v](w + (i & 1), x, dm, dx, blocks);
                __asm__ volatile("" ::: "memory");
            }
            const double rate = (double)reps * blocks * 8 * R * G / (now() - t0) / 1e9;
            if (rate > best) best = rate;
        }
        printf("%-18s %5.2f G vpdpbusd/s  (%g)\n", names[v], best, (double)sink);
    }
    printf("clock about %.2f GHz (dependent adds)\n", clock_ghz());
    return 0;
}
