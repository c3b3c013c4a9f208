// harness.cpp: runs kernels/quant.cu's own code on the host (see shim.h).
//   harness deq TYPE COLS ROW_FILE OUT_FILE
//       OUT = f32 dequant_elem(TYPE, row, e) for e < COLS
//   harness mmvq TYPE ROWS COLS N W_FILE X_FILE OUT_FILE
//       OUT = f32 y[N][ROWS] of mmvq_<TYPE>: each warp's 32 lanes run one
//       after another, then their warp_sum values are summed as the
//       butterfly does.
// KERNEL names the .cu file (-DKERNEL=\"path\").
#include "shim.h"
#include KERNEL
#include <cstdio>
#include <cstdlib>
#include <string>

static std::vector<unsigned char> slurp(const char* path) {
    FILE* f = std::fopen(path, "rb");
    if (!f) std::exit(3);
    std::vector<unsigned char> b;
    unsigned char buf[65536];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) b.insert(b.end(), buf, buf + n);
    std::fclose(f);
    return b;
}

static void spit(const char* path, const std::vector<float>& v) {
    FILE* f = std::fopen(path, "wb");
    if (!f || std::fwrite(v.data(), 4, v.size(), f) != v.size()) std::exit(4);
    std::fclose(f);
}

static float butterfly(const float* lanes) {
    float v[32];
    std::memcpy(v, lanes, sizeof v);
    for (int o = 16; o > 0; o >>= 1) {
        float p[32];
        std::memcpy(p, v, sizeof v);
        for (int i = 0; i < 32; i++) v[i] = p[i] + p[i ^ o];
    }
    return v[0];
}

typedef void (*Mmvq)(const u8*, const Q8*, float*, int, int, int, int);

static Mmvq mmvq_of(int t) {
    switch (t) {
    case GT_Q4_0: return mmvq_q4_0;
    case GT_Q4_1: return mmvq_q4_1;
    case GT_Q5_0: return mmvq_q5_0;
    case GT_Q5_1: return mmvq_q5_1;
    case GT_Q8_0: return mmvq_q8_0;
    case GT_Q4_K: return mmvq_q4_k;
    case GT_Q5_K: return mmvq_q5_k;
    case GT_Q6_K: return mmvq_q6_k;
    default: std::exit(5);
    }
}

int main(int argc, char** argv) {
    if (argc < 2) return 2;
    std::string mode = argv[1];
    if (mode == "deq" && argc == 6) {
        int t = std::atoi(argv[2]), cols = std::atoi(argv[3]);
        std::vector<unsigned char> row = slurp(argv[4]);
        std::vector<float> out(cols);
        for (int e = 0; e < cols; e++) out[e] = dequant_elem(t, row.data(), e);
        spit(argv[5], out);
        return 0;
    }
    if (mode == "mmvq" && argc == 9) {
        int t = std::atoi(argv[2]), rows = std::atoi(argv[3]), cols = std::atoi(argv[4]);
        int n = std::atoi(argv[5]);
        std::vector<unsigned char> w = slurp(argv[6]), xb = slurp(argv[7]);
        if (xb.size() != (size_t)n * (cols / 32) * sizeof(Q8)) return 6;
        std::vector<Q8> x(xb.size() / sizeof(Q8));
        std::memcpy(x.data(), xb.data(), xb.size());
        std::vector<float> y((size_t)n * rows), out((size_t)n * rows);
        Mmvq k = mmvq_of(t);
        blockDim.x = MMVQ_WARPS * 32;
        for (int row = 0; row < rows; row++) {
            std::vector<float> lanes((size_t)n * 32);
            blockIdx.x = row / MMVQ_WARPS;
            for (int lane = 0; lane < 32; lane++) {
                threadIdx.x = (row % MMVQ_WARPS) * 32 + lane;
                g_lane_values.clear();
                k(w.data(), x.data(), y.data(), rows, cols, rows, n);
                if (g_lane_values.size() != (size_t)n) return 7;
                for (int r = 0; r < n; r++) lanes[r * 32 + lane] = g_lane_values[r];
            }
            for (int r = 0; r < n; r++) out[(size_t)r * rows + row] = butterfly(&lanes[r * 32]);
        }
        spit(argv[8], out);
        return 0;
    }
    return 2;
}
