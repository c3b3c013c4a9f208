// harness.cpp: runs Kestrel's kernels on the host (see shim.h). The test
// prepends shim.h, then common.cuh and the kernel files (inline PTX
// rewritten), and appends this file. Every argument is a number or a file
// of raw little-endian values; OUT files are written whole.
//
//   mmvq T ROWS COLS N XOFF W X OUT   y[N][ROWS] f32 = mmvq_<T>(W, X: activation
//                                     rows placed XOFF bytes into a 16-aligned buffer)
//   dequant T ROW0 NROWS COLS W OUT   f16 tile of rows ROW0.. (dequant_f16)
//   embed T HIDDEN VOCAB N TABLE TOKENS OUT   f32 rows (embed_gather_q)
//   quant_h COLS N X OUT              activation rows of f16 rows (quantize_q8_h)
//   norm HIDDEN N EPS X DELTA W OUT_X OUT_Q  add_rms_norm_q8 (x updated)
//   swiglu F N GATE_UP OUT            activation rows (swiglu_q8)
//   rope_kv NQ NK HD ROT INTERLEAVED N CACHE_SLOTS NORM EPS QKV TABLE POS SLOTS QN KN OUT_QKV OUT_K OUT_V
//                                     rope_kv_append into zeroed f16 caches
//                                     (NORM 1: per-head q/k norms QN, KN)
//   post_norm HIDDEN N EPS X W OUT_X  rms_norm_f32 in place
//   gelu F N GATE_UP OUT_H OUT_Q      f16 rows (gelu_mul) and activation rows (gelu_mul_q8)
//   elementwise S CAP LEN X OUT_SCALED OUT_CAPPED  scale_f32 and softcap
//   phi HIDDEN F N EPS X DELTA W B Y FB OUT_X OUT_H OUT_G OUT_XY
//                                     add_layer_norm (x updated, f16 rows),
//                                     bias_gelu of Y (N x F, bias FB), add_f32 x += y
//   spatial CB SB N COORD_ID SIZE_ID CH SH HIDDEN CL SL TABLE TOKENS ROWS PENDING CW SW X CE SE
//           OUT_VALUES OUT_PENDING OUT_CF OUT_SF OUT_X
//                                     spatial_values, fourier_features of the
//                                     pending values, spatial_embed into X
//   hidden_f16 HIDDEN N X OUT_ROW OUT  f16 rows of X routed by OUT_ROW (-1: none)
//   accept_values N QO ACCEPTED KV_ROWS VALUES PENDING OUT  pending values after accept_drafts
//   prefill_attn NH NKV HD PS SCALE WINDOW STRIDE N QKV ROW_SEQ ROW_POS KV_INDPTR KV_INDICES K V OUT
//                                     f16 rows of prefill_attention
//   count VOCAB N ROWS INDPTR TOKENS COUNTS OUT   count_tokens onto COUNTS ([rows][vocab] u32)
//   verify VOCAB N MAXROWS PENDING KV_ROWS QO DRAFTS COUNTS SAMPLED
//          OUT_TOKENS OUT_SCRATCH OUT_COUNTS OUT_PENDING OUT_ACCEPTED
//                                     verify_inputs, draft_counts, then
//                                     accept_drafts of SAMPLED
//   embed_f16 HIDDEN VOCAB N INDIRECT TABLE TOKENS ROWS OUT   f32 rows (embed_gather;
//                                     INDIRECT 1: tokens[rows[i]], the decode path)
//   bias STRIDE D N Y B OUT           add_bias on N rows of Y
//   sample VOCAB N WORDS TOP_N LOGITS MASK_WORDS MASK_FLAGS PARAMS ROWS POSITIONS COUNTS
//          BIAS_INDPTR BIAS OUT_TOKENS OUT_LPS OUT_TOP_IDS OUT_TOP_LPS OUT_COUNTS OUT_PENDING
//                                     sample_rows (empty MASK_WORDS / BIAS_INDPTR: none)
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

template <class T>
static std::vector<T> read_as(const char* path) {
    std::vector<unsigned char> b = slurp(path);
    std::vector<T> v(b.size() / sizeof(T));
    std::memcpy(v.data(), b.data(), v.size() * sizeof(T));
    return v;
}

template <class T>
static void spit(const char* path, const std::vector<T>& v) {
    FILE* f = std::fopen(path, "wb");
    if (!f || std::fwrite(v.data(), sizeof(T), v.size(), f) != v.size()) std::exit(4);
    std::fclose(f);
}

typedef void (*Mmvq)(const u8*, const u8*, float*, int, int, int, int);

// The entry point the runtime launches for n rows (quant::mmvq_kernel).
#define MMVQ_PICK(name)                                                            \
    (n <= 1 ? name##_r1 : n <= 2 ? name##_r2 : n <= 4 ? name##_r4 : n <= 8 ? name##_r8 \
                                                                         : name##_r16)
static Mmvq mmvq_of(int t, int n) {
    switch (t) {
    case GT_Q4_0: return MMVQ_PICK(mmvq_q4_0);
    case GT_Q4_1: return MMVQ_PICK(mmvq_q4_1);
    case GT_Q5_0: return MMVQ_PICK(mmvq_q5_0);
    case GT_Q5_1: return MMVQ_PICK(mmvq_q5_1);
    case GT_Q8_0: return MMVQ_PICK(mmvq_q8_0);
    case GT_Q4_K: return MMVQ_PICK(mmvq_q4_k);
    case GT_Q5_K: return MMVQ_PICK(mmvq_q5_k);
    case GT_Q6_K: return MMVQ_PICK(mmvq_q6_k);
    default: std::exit(5);
    }
}

int main(int argc, char** argv) {
    if (argc < 2) return 2;
    std::string mode = argv[1];
    auto I = [&](int i) { return std::atoi(argv[i]); };
    if (mode == "mmvq" && argc == 10) {
        int t = I(2), rows = I(3), cols = I(4), n = I(5), xoff = I(6);
        std::vector<u8> w = read_as<u8>(argv[7]);
        std::vector<u8> x = read_as<u8>(argv[8]);
        // The rows at xoff bytes into a 16-byte aligned buffer (uint4 holds
        // 16-byte alignment), as the device sees an offset pointer.
        std::vector<uint4> buf((x.size() + xoff + 15) / 16);
        u8* xp = (u8*)buf.data() + xoff;
        std::memcpy(xp, x.data(), x.size());
        std::vector<float> y((size_t)n * rows, -1.0f);
        Mmvq k = mmvq_of(t, n);
        launch({rows, 1, 1}, MMVQ_WARPS * 32,
               [&] { k(w.data(), xp, y.data(), rows, cols, rows, n); });
        spit(argv[9], y);
        return 0;
    }
    if (mode == "dequant" && argc == 8) {
        int t = I(2), row0 = I(3), nrows = I(4), cols = I(5);
        std::vector<u8> w = read_as<u8>(argv[6]);
        std::vector<h16> out((size_t)nrows * cols);
        launch({3, 1, 1}, 64, [&] { dequant_f16(w.data(), t, row0, nrows, cols, out.data()); });
        spit(argv[7], out);
        return 0;
    }
    if (mode == "embed" && argc == 9) {
        int t = I(2), hidden = I(3), vocab = I(4), n = I(5);
        std::vector<u8> table = read_as<u8>(argv[6]);
        std::vector<u32> tokens = read_as<u32>(argv[7]);
        std::vector<float> x((size_t)n * hidden);
        launch({n, 1, 1}, 256, [&] {
            embed_gather_q(table.data(), t, tokens.data(), nullptr, x.data(), hidden, vocab, n);
        });
        spit(argv[8], x);
        return 0;
    }
    if (mode == "quant_h" && argc == 6) {
        int cols = I(2), n = I(3);
        std::vector<h16> x = read_as<h16>(argv[4]);
        std::vector<u8> out((size_t)n * cols / 32 * 40);
        launch({(cols / 32 + 7) / 8, n, 1}, 256, [&] { quantize_q8_h(x.data(), out.data(), cols, n); });
        spit(argv[5], out);
        return 0;
    }
    if (mode == "norm" && argc == 10) {
        int hidden = I(2), n = I(3);
        float eps = std::strtof(argv[4], nullptr);
        std::vector<float> x = read_as<float>(argv[5]), delta = read_as<float>(argv[6]);
        std::vector<float> w = read_as<float>(argv[7]);
        std::vector<u8> out((size_t)n * hidden / 32 * 40);
        launch({n, 1, 1}, NORM_THREADS, [&] {
            add_rms_norm_q8(x.data(), delta.data(), w.data(), out.data(), nullptr, hidden, eps, n);
        });
        spit(argv[8], x);
        spit(argv[9], out);
        return 0;
    }
    if (mode == "swiglu" && argc == 6) {
        int f = I(2), n = I(3);
        std::vector<float> gu = read_as<float>(argv[4]);
        std::vector<u8> out((size_t)n * f / 32 * 40);
        launch({(f / 32 + 7) / 8, n, 1}, 256, [&] { swiglu_q8(gu.data(), out.data(), f, n); });
        spit(argv[5], out);
        return 0;
    }
    if (mode == "rope_kv" && argc == 20) {
        int nq = I(2), nk = I(3), hd = I(4), rot = I(5), interleaved = I(6), n = I(7);
        int cache_slots = I(8), norm = I(9);
        float eps = std::strtof(argv[10], nullptr);
        std::vector<float> qkv = read_as<float>(argv[11]), table = read_as<float>(argv[12]);
        std::vector<u32> pos = read_as<u32>(argv[13]), slots = read_as<u32>(argv[14]);
        std::vector<float> qn = read_as<float>(argv[15]), kn = read_as<float>(argv[16]);
        size_t kv_dim = (size_t)nk * hd;
        std::vector<h16> kc(cache_slots * kv_dim), vc(cache_slots * kv_dim);
        int stride = (nq + 2 * nk) * hd;
        // The device's shape: a block per 4 heads of a row.
        launch({n, (nq + nk + 3) / 4, 1}, 128, [&] {
            rope_kv_append(qkv.data(), stride, nq, nk, hd, rot, table.data(), pos.data(),
                           interleaved, norm ? qn.data() : nullptr, norm ? kn.data() : nullptr,
                           eps, kc.data(), vc.data(), slots.data(), n);
        });
        spit(argv[17], qkv);
        spit(argv[18], kc);
        spit(argv[19], vc);
        return 0;
    }
    if (mode == "post_norm" && argc == 8) {
        int hidden = I(2), n = I(3);
        float eps = std::strtof(argv[4], nullptr);
        std::vector<float> x = read_as<float>(argv[5]), w = read_as<float>(argv[6]);
        launch({n, 1, 1}, NORM_THREADS, [&] { rms_norm_f32(x.data(), w.data(), hidden, eps, n); });
        spit(argv[7], x);
        return 0;
    }
    if (mode == "gelu" && argc == 7) {
        int f = I(2), n = I(3);
        std::vector<float> gu = read_as<float>(argv[4]);
        std::vector<h16> out_h((size_t)n * f);
        std::vector<u8> out_q((size_t)n * f / 32 * 40);
        launch({3, 1, 1}, 256, [&] { gelu_mul(gu.data(), out_h.data(), f, n); });
        launch({(f / 32 + 7) / 8, n, 1}, 256, [&] { gelu_mul_q8(gu.data(), out_q.data(), f, n); });
        spit(argv[5], out_h);
        spit(argv[6], out_q);
        return 0;
    }
    if (mode == "elementwise" && argc == 8) {
        float s = std::strtof(argv[2], nullptr), cap = std::strtof(argv[3], nullptr);
        u64 len = (u64)std::atoll(argv[4]);
        std::vector<float> x = read_as<float>(argv[5]), y = x;
        launch({2, 1, 1}, 64, [&] { scale_f32(x.data(), s, len); });
        launch({2, 1, 1}, 64, [&] { softcap(y.data(), cap, len); });
        spit(argv[6], x);
        spit(argv[7], y);
        return 0;
    }
    if (mode == "phi" && argc == 16) {
        int hidden = I(2), f = I(3), n = I(4);
        float eps = std::strtof(argv[5], nullptr);
        std::vector<float> x = read_as<float>(argv[6]), delta = read_as<float>(argv[7]);
        std::vector<float> w = read_as<float>(argv[8]), b = read_as<float>(argv[9]);
        std::vector<float> y = read_as<float>(argv[10]), fb = read_as<float>(argv[11]);
        std::vector<h16> out((size_t)n * hidden), g((size_t)n * f);
        launch({n, 1, 1}, NORM_THREADS, [&] {
            add_layer_norm(x.data(), delta.data(), w.data(), b.data(), out.data(), nullptr,
                           hidden, eps, n);
        });
        launch({3, 1, 1}, 64, [&] { bias_gelu(y.data(), fb.data(), g.data(), f, n); });
        std::vector<float> xy = x;
        launch({2, 1, 1}, 64, [&] { add_f32(xy.data(), delta.data(), (u64)n * hidden); });
        spit(argv[12], x);
        spit(argv[13], out);
        spit(argv[14], g);
        spit(argv[15], xy);
        return 0;
    }
    if (mode == "spatial" && argc == 26) {
        int cb = I(2), sb = I(3), n = I(4);
        u32 coord_id = (u32)I(5), size_id = (u32)I(6);
        int ch = I(7), sh = I(8), hidden = I(9);
        std::vector<float> cl = read_as<float>(argv[10]), sl = read_as<float>(argv[11]);
        std::vector<float> table = read_as<float>(argv[12]);
        std::vector<u32> tokens = read_as<u32>(argv[13]), rows = read_as<u32>(argv[14]);
        std::vector<float> pending = read_as<float>(argv[15]);
        std::vector<float> cw = read_as<float>(argv[16]), sw = read_as<float>(argv[17]);
        std::vector<float> x = read_as<float>(argv[18]);
        std::vector<float> ce = read_as<float>(argv[19]), se = read_as<float>(argv[20]);
        std::vector<float> values((size_t)n * 3, -1.0f);
        std::vector<h16> cf((size_t)n * 2 * ch), sf((size_t)n * 2 * sh);
        launch({n, 1, 1}, SPATIAL_THREADS, [&] {
            spatial_values(cl.data(), cb, sl.data(), sb, table.data(), tokens.data(), rows.data(),
                           coord_id, size_id, values.data(), pending.data(), n);
        });
        launch({2, 1, 1}, 64, [&] {
            fourier_features(pending.data(), rows.data(), cw.data(), ch, sw.data(), sh, cf.data(),
                             sf.data(), n);
        });
        // The next step's inputs: the sampled tokens by KV row.
        std::vector<u32> by_row(pending.size() / 3, 0);
        for (int i = 0; i < n; i++) by_row[rows[i]] = tokens[i];
        launch({n, 1, 1}, 64, [&] {
            spatial_embed(x.data(), ce.data(), se.data(), by_row.data(), rows.data(), coord_id,
                          size_id, hidden, n);
        });
        spit(argv[21], values);
        spit(argv[22], pending);
        spit(argv[23], cf);
        spit(argv[24], sf);
        spit(argv[25], x);
        return 0;
    }
    if (mode == "hidden_f16" && argc == 7) {
        int hidden = I(2), n = I(3);
        std::vector<float> x = read_as<float>(argv[4]);
        std::vector<int> out_row = read_as<int>(argv[5]);
        std::vector<h16> out((size_t)n * hidden, 0);
        launch({n, 1, 1}, 64, [&] { hidden_f16(x.data(), out_row.data(), out.data(), hidden, n); });
        spit(argv[6], out);
        return 0;
    }
    if (mode == "accept_values" && argc == 9) {
        int n = I(2);
        std::vector<u32> qo = read_as<u32>(argv[3]), acc = read_as<u32>(argv[4]);
        std::vector<u32> kv = read_as<u32>(argv[5]);
        std::vector<float> values = read_as<float>(argv[6]), pending = read_as<float>(argv[7]);
        launch({1, 1, 1}, 64, [&] {
            accept_values(qo.data(), acc.data(), kv.data(), values.data(), pending.data(), n);
        });
        spit(argv[8], pending);
        return 0;
    }
    if (mode == "prefill_attn" && argc == 18) {
        int nh = I(2), nkv = I(3), hd = I(4), ps = I(5);
        float scale = std::strtof(argv[6], nullptr);
        int window = I(7), stride = I(8), n = I(9);
        std::vector<float> qkv = read_as<float>(argv[10]);
        std::vector<u32> seq = read_as<u32>(argv[11]), pos = read_as<u32>(argv[12]);
        std::vector<u32> indptr = read_as<u32>(argv[13]), indices = read_as<u32>(argv[14]);
        std::vector<h16> kc = read_as<h16>(argv[15]), vc = read_as<h16>(argv[16]);
        std::vector<h16> out((size_t)n * nh * hd);
        launch({nh, (n + PF_Q_ROWS - 1) / PF_Q_ROWS, 1}, PF_WARPS * 32, [&] {
            prefill_attention(qkv.data(), stride, out.data(), kc.data(), vc.data(), seq.data(),
                              pos.data(), indptr.data(), indices.data(), nh, nkv, hd, ps, scale,
                              window, n);
        });
        spit(argv[17], out);
        return 0;
    }
    if (mode == "decode_attn" && argc == 19) {
        int nh = I(2), nkv = I(3), hd = I(4), ps = I(5);
        float scale = std::strtof(argv[6], nullptr);
        int window = I(7), stride = I(8), n = I(9), splits = I(10);
        std::vector<float> qkv = read_as<float>(argv[11]);
        std::vector<u32> seq = read_as<u32>(argv[12]), pos = read_as<u32>(argv[13]);
        std::vector<u32> indptr = read_as<u32>(argv[14]), indices = read_as<u32>(argv[15]);
        std::vector<h16> kc = read_as<h16>(argv[16]), vc = read_as<h16>(argv[17]);
        std::vector<h16> out((size_t)n * nh * hd);
        // Unwritten ranges would read as NaN.
        std::vector<float> part((size_t)n * nh * splits * (hd + 2), NAN);
        int group = nh / nkv, hblocks = (group + ATT_HB - 1) / ATT_HB;
        launch({nkv * hblocks, n, splits}, ATT_THREADS, [&] {
            paged_attention(qkv.data(), stride, kc.data(), vc.data(), seq.data(), pos.data(),
                            indptr.data(), indices.data(), nh, nkv, hd, ps, scale, window, n,
                            splits, part.data());
        });
        launch({nh, n, 1}, ATT_THREADS, [&] {
            paged_attention_merge(part.data(), pos.data(), out.data(), nh, hd, window, n, splits);
        });
        spit(argv[18], out);
        return 0;
    }
    if (mode == "count" && argc == 9) {
        int vocab = I(2), n = I(3);
        std::vector<u32> rows = read_as<u32>(argv[4]), indptr = read_as<u32>(argv[5]);
        std::vector<u32> tokens = read_as<u32>(argv[6]), counts = read_as<u32>(argv[7]);
        launch({n, 1, 1}, 128, [&] {
            count_tokens(counts.data(), rows.data(), indptr.data(), tokens.data(), vocab, n);
        });
        spit(argv[8], counts);
        return 0;
    }
    if (mode == "verify" && argc == 16) {
        int vocab = I(2), n = I(3), maxrows = I(4);
        std::vector<u32> pending = read_as<u32>(argv[5]), rows = read_as<u32>(argv[6]);
        std::vector<u32> qo = read_as<u32>(argv[7]), drafts = read_as<u32>(argv[8]);
        std::vector<u32> counts = read_as<u32>(argv[9]), sampled = read_as<u32>(argv[10]);
        size_t total = qo[n];
        std::vector<u32> tokens(total), scratch(total * vocab), accepted(n);
        launch({n, 1, 1}, 32, [&] {
            verify_inputs(pending.data(), rows.data(), qo.data(), drafts.data(), tokens.data(), n);
        });
        launch({n, maxrows, 1}, 256, [&] {
            draft_counts(counts.data(), rows.data(), qo.data(), tokens.data(), scratch.data(),
                         vocab, n);
        });
        launch({(n + 63) / 64, 1, 1}, 64, [&] {
            accept_drafts(qo.data(), tokens.data(), sampled.data(), rows.data(), counts.data(),
                          pending.data(), accepted.data(), vocab, n);
        });
        spit(argv[11], tokens);
        spit(argv[12], scratch);
        spit(argv[13], counts);
        spit(argv[14], pending);
        spit(argv[15], accepted);
        return 0;
    }
    if (mode == "embed_f16" && argc == 10) {
        int hidden = I(2), vocab = I(3), n = I(4), indirect = I(5);
        std::vector<h16> table = read_as<h16>(argv[6]);
        std::vector<u32> tokens = read_as<u32>(argv[7]), rows = read_as<u32>(argv[8]);
        std::vector<float> x((size_t)n * hidden, -1.0f);
        launch({n, 1, 1}, 64, [&] {
            embed_gather(table.data(), tokens.data(), indirect ? rows.data() : nullptr, x.data(),
                         hidden, vocab, n);
        });
        spit(argv[9], x);
        return 0;
    }
    if (mode == "bias" && argc == 8) {
        int stride = I(2), d = I(3), n = I(4);
        std::vector<float> y = read_as<float>(argv[5]), b = read_as<float>(argv[6]);
        launch({n, 1, 1}, 64, [&] { add_bias(y.data(), b.data(), stride, d, n); });
        spit(argv[7], y);
        return 0;
    }
    if (mode == "sample" && argc == 21) {
        int vocab = I(2), n = I(3), words = I(4), top_n = I(5);
        std::vector<float> logits = read_as<float>(argv[6]);
        std::vector<u32> mask_words = read_as<u32>(argv[7]), mask_flags = read_as<u32>(argv[8]);
        std::vector<SampleParams> params = read_as<SampleParams>(argv[9]);
        std::vector<u32> rows = read_as<u32>(argv[10]), positions = read_as<u32>(argv[11]);
        std::vector<u32> counts = read_as<u32>(argv[12]);
        std::vector<u32> bias_indptr = read_as<u32>(argv[13]), bias = read_as<u32>(argv[14]);
        std::vector<u32> tokens(n), top_ids((size_t)n * top_n + 1);
        std::vector<float> lps(n), top_lps((size_t)n * top_n + 1);
        std::vector<u32> pending(counts.size() / vocab, 0xffffffffu);
        // 128 threads, not the device's SAMPLE_THREADS: the kernel takes
        // any multiple of 32 up to it (blockDim.x), and 1024 host threads
        // meeting at every barrier of 64 bisection passes take minutes.
        launch({n, 1, 1}, 128, [&] {
            sample_rows(logits.data(), vocab, mask_words.empty() ? nullptr : mask_words.data(),
                        mask_words.empty() ? nullptr : mask_flags.data(), words, params.data(),
                        rows.data(), positions.data(), counts.data(), pending.data(),
                        tokens.data(), lps.data(), top_ids.data(), top_lps.data(),
                        bias_indptr.empty() ? nullptr : bias_indptr.data(), bias.data(), top_n,
                        n);
        });
        top_ids.resize((size_t)n * top_n);
        top_lps.resize((size_t)n * top_n);
        spit(argv[15], tokens);
        spit(argv[16], lps);
        spit(argv[17], top_ids);
        spit(argv[18], top_lps);
        spit(argv[19], counts);
        spit(argv[20], pending);
        return 0;
    }
    return 2;
}
