/* llama.cpp's reference K-quant quantizers (ggml-quants.c, compiled
 * unchanged beside this file) as a command, for
 * crates/kestrel-model/tests/quantize_reference.rs:
 *
 *     ggml_kquant_ref TYPE IN.f32 OUT.bin      (TYPE: q4_K, q5_K or q6_K)
 *
 * Build (the test does this when KESTREL_LLAMA_CPP_SRC names a llama.cpp
 * tree, e.g. vendor/llama.cpp of the llama-cpp-python==0.3.36 sdist):
 *
 *     cc -O2 -ffp-contract=off -I$G/include -I$G/src ggml_kquant_ref.c $G/src/ggml-quants.c -lm
 *
 * with G=$KESTREL_LLAMA_CPP_SRC/ggml. No FMA contraction: the reference is
 * the C source's own f32 arithmetic. */
#define GGML_COMMON_DECL_C
#include "ggml-common.h"
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

void quantize_row_q4_K_ref(const float *, block_q4_K *, int64_t);
void quantize_row_q5_K_ref(const float *, block_q5_K *, int64_t);
void quantize_row_q6_K_ref(const float *, block_q6_K *, int64_t);

/* ggml-quants.c references these from paths the reference quantizers never take. */
void ggml_abort(const char *file, int line, const char *fmt, ...) {
    (void)fmt;
    fprintf(stderr, "ggml_abort at %s:%d\n", file, line);
    abort();
}
size_t ggml_row_size(int type, int64_t ne) { (void)type; (void)ne; abort(); }
const char *ggml_type_name(int type) { (void)type; abort(); }
size_t ggml_type_size(int type) { (void)type; abort(); }

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s q4_K|q5_K|q6_K IN.f32 OUT.bin\n", argv[0]);
        return 2;
    }
    FILE *in = fopen(argv[2], "rb");
    if (!in) { perror(argv[2]); return 1; }
    fseek(in, 0, SEEK_END);
    long n = ftell(in) / 4;
    fseek(in, 0, SEEK_SET);
    if (n % QK_K != 0) { fprintf(stderr, "%ld values is not a multiple of %d\n", n, QK_K); return 1; }
    float *x = malloc((size_t)n * 4);
    if (fread(x, 4, (size_t)n, in) != (size_t)n) { perror("read"); return 1; }
    fclose(in);
    size_t bs;
    void *y;
    if (!strcasecmp(argv[1], "q4_K")) {
        bs = sizeof(block_q4_K); y = malloc((size_t)n / QK_K * bs); quantize_row_q4_K_ref(x, y, n);
    } else if (!strcasecmp(argv[1], "q5_K")) {
        bs = sizeof(block_q5_K); y = malloc((size_t)n / QK_K * bs); quantize_row_q5_K_ref(x, y, n);
    } else if (!strcasecmp(argv[1], "q6_K")) {
        bs = sizeof(block_q6_K); y = malloc((size_t)n / QK_K * bs); quantize_row_q6_K_ref(x, y, n);
    } else {
        fprintf(stderr, "unknown type %s\n", argv[1]);
        return 2;
    }
    FILE *out = fopen(argv[3], "wb");
    if (!out || fwrite(y, bs, (size_t)n / QK_K, out) != (size_t)n / QK_K) { perror(argv[3]); return 1; }
    fclose(out);
    return 0;
}
