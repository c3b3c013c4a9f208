// sample.cu: token sampling, one block per row, mirroring kestrel-cpu's
// `sampler::sample` step for step: skills' bitmask (u32 words, bit t%32 of
// word t/32 set = allowed) -> logit_bias -> repetition / frequency / presence penalties
// from the row's generated-token counts -> temperature -> top-k -> top-p ->
// min-p -> draw (or argmax when greedy), with the logprob of the chosen token
// and the top-n alternatives of the final distribution.
//
// Candidate sets use the CPU's total order (logit descending, id ascending):
// top-k and top-p thresholds are found by bisection on order-preserving u32
// keys (32 block passes) plus a bisection on ids for ties, so no sort is
// needed. The draw is counter-based (splitmix64 of (seed, position), the
// CPU's `uniform`), walking candidates in id order: a request's tokens never
// depend on its batch. Masses are summed in f64 as on the CPU (in a different
// order, so a draw landing within rounding of a boundary may differ).
// Greedy rows are exact. Logits are rewritten in place (the slot's buffer).

#define SAMPLE_THREADS 1024

// Mirrors `kestrel_cuda::ffi::SampleParams` (#[repr(C)], 40 bytes).
struct SampleParams {
    float temperature;
    u32 top_k;
    float top_p;
    float min_p;
    float repetition_penalty;
    float frequency_penalty;
    float presence_penalty;
    u32 _pad;
    u64 seed;
};

__device__ __forceinline__ u64 splitmix(u64 z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// kestrel-cpu `sampler::uniform`.
__device__ double uniform01(u64 seed, u32 position) {
    u64 h = splitmix(seed ^ splitmix((u64)position ^ 0xD1B54A32D192ED03ull));
    return (double)(h >> 11) / (double)(1ull << 53);
}

// Ascending unsigned order == ascending float order (-inf lowest).
__device__ __forceinline__ u32 fkey(float f) {
    u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The upper midpoint of [lo, hi] for a "largest x with P(x)" bisection
// (lo < hi). `lo + (hi - lo + 1) / 2` would wrap to `lo` when the range is
// all of u32, and the loop would never end.
__device__ __forceinline__ u32 upper_mid(u32 lo, u32 hi) {
    return hi - (hi - lo) / 2;
}

// __launch_bounds__ caps registers so 1024-thread blocks always launch.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_rows(float* __restrict__ logits,
                                       int vocab,
                                       const u32* __restrict__ mask_words,
                                       const u32* __restrict__ mask_flags,
                                       int words_per_row,
                                       const SampleParams* __restrict__ params,
                                       const u32* __restrict__ rows,
                                       const u32* __restrict__ positions,
                                       u32* __restrict__ counts,
                                       u32* __restrict__ pending,
                                       u32* __restrict__ out_tokens,
                                       float* __restrict__ out_logprobs,
                                       u32* __restrict__ out_top_ids,
                                       float* __restrict__ out_top_lps,
                                       const u32* __restrict__ bias_indptr,
                                       const u32* __restrict__ bias,
                                       int top_n, int n) {
    __shared__ float shf[32];
    __shared__ double shd[32];
    __shared__ u32 shu[32];
    int i = blockIdx.x;
    if (i >= n) return;
    const int tid = threadIdx.x, nt = blockDim.x;
    float* v = logits + (size_t)i * vocab;
    const SampleParams P = params[i];
    u32 kv_row = rows[i];
    u32* cnt = counts + (size_t)kv_row * vocab;
    const u32* mw = (mask_words && mask_flags && mask_flags[i])
                        ? mask_words + (size_t)i * words_per_row : nullptr;
    const bool greedy = P.temperature <= 0.0f;
    const float inv_t = greedy ? 1.0f : 1.0f / P.temperature;
    const float rp = P.repetition_penalty, fp = P.frequency_penalty, pp = P.presence_penalty;
    const bool pen = rp != 1.0f || fp != 0.0f || pp != 0.0f;

    // 0. logit_bias (OpenAI's): row i's entries bias_indptr[i] ..
    // bias_indptr[i + 1] of `bias`, (token, value bits) pairs with distinct
    // tokens, added before the mask (which sets -inf regardless: no bias
    // unmasks a token) and the penalties, as kestrel-cpu's `sample`.
    if (bias_indptr) {
        u32 b0 = bias_indptr[i], b1 = bias_indptr[i + 1];
        for (u32 e = b0 + tid; e < b1; e += nt) {
            u32 t = bias[2 * e];
            if (t < (u32)vocab) v[t] = __fadd_rn(v[t], __uint_as_float(bias[2 * e + 1]));
        }
        __syncthreads();
    }

    // 1. mask, penalties, temperature; max and candidate count.
    float lmax = KESTREL_NEG_INF;
    u32 lcount = 0;
    for (int t = tid; t < vocab; t += nt) {
        float l = v[t];
        if (mw && !((mw[t >> 5] >> (t & 31)) & 1u)) l = KESTREL_NEG_INF;
        if (pen) {
            u32 c = cnt[t];
            if (c > 0) {
                if (rp != 1.0f) l = l > 0.0f ? __fdiv_rn(l, rp) : __fmul_rn(l, rp);
                l = __fsub_rn(l, __fadd_rn(__fmul_rn(fp, (float)c), pp));
            }
        }
        l = l > KESTREL_NEG_INF ? __fmul_rn(l, inv_t) : KESTREL_NEG_INF;
        v[t] = l;
        if (l > KESTREL_NEG_INF) {
            lcount++;
            lmax = fmaxf(lmax, l);
        }
    }
    const float mx = block_max(lmax, shf);
    const u32 count = block_sum_u32(lcount, shu);

    if (count == 0) {
        // A mask that allows nothing: token 0 with -inf (the skill rejects it).
        if (tid == 0) {
            out_tokens[i] = 0;
            out_logprobs[i] = KESTREL_NEG_INF;
            pending[kv_row] = 0;
            cnt[0] += 1;
        }
        for (int j = tid; j < top_n; j += nt) {
            out_top_ids[(size_t)i * top_n + j] = 0;
            out_top_lps[(size_t)i * top_n + j] = KESTREL_NEG_INF;
        }
        return;
    }

    // 2. top-k: keep the k greatest in (value desc, id asc) order.
    if (!greedy && P.top_k > 0 && P.top_k < count) {
        u32 k = P.top_k;
        // Largest key K with |{key >= K}| >= k (some finite key qualifies,
        // as count >= k finite values exist, so K > fkey(-inf)).
        u32 lo = fkey(KESTREL_NEG_INF) + 1, hi = 0xffffffffu;
        while (lo < hi) {
            u32 mid = upper_mid(lo, hi);
            u32 c = 0;
            for (int t = tid; t < vocab; t += nt) c += fkey(v[t]) >= mid;
            c = block_sum_u32(c, shu);
            if (c >= k) lo = mid; else hi = mid - 1;
        }
        u32 K = lo, gt = 0;
        for (int t = tid; t < vocab; t += nt) gt += fkey(v[t]) > K;
        gt = block_sum_u32(gt, shu);
        u32 need = k - gt;
        // Smallest id bound X with |{key == K, id < X}| >= need.
        u32 ilo = 1, ihi = (u32)vocab;
        while (ilo < ihi) {
            u32 mid = ilo + (ihi - ilo) / 2;
            u32 c = 0;
            for (int t = tid; t < (int)mid; t += nt) c += fkey(v[t]) == K;
            c = block_sum_u32(c, shu);
            if (c >= need) ihi = mid; else ilo = mid + 1;
        }
        for (int t = tid; t < vocab; t += nt) {
            u32 key = fkey(v[t]);
            if (!(key > K || (key == K && (u32)t < ilo))) v[t] = KESTREL_NEG_INF;
        }
        __syncthreads();
    }

    // 3. top-p: the shortest (value desc, id asc) prefix holding top_p of the mass.
    if (!greedy && P.top_p < 1.0f) {
        double z = 0.0;
        for (int t = tid; t < vocab; t += nt)
            if (v[t] > KESTREL_NEG_INF) z += (double)kexp(v[t] - mx);
        z = block_sum_f64(z, shd);
        double target = (double)P.top_p * z;
        // Largest key K with mass{key >= K} >= target (exists unless rounding
        // leaves the total short, in which case the CPU keeps everything).
        u32 lo = fkey(KESTREL_NEG_INF) + 1, hi = 0xffffffffu;
        double mlo = 0.0;
        for (int t = tid; t < vocab; t += nt)
            if (fkey(v[t]) >= lo) mlo += (double)kexp(v[t] - mx);
        mlo = block_sum_f64(mlo, shd);
        if (mlo >= target) {
            while (lo < hi) {
                u32 mid = upper_mid(lo, hi);
                double m = 0.0;
                for (int t = tid; t < vocab; t += nt)
                    if (fkey(v[t]) >= mid) m += (double)kexp(v[t] - mx);
                m = block_sum_f64(m, shd);
                if (m >= target) lo = mid; else hi = mid - 1;
            }
            u32 K = lo;
            double gt = 0.0;
            for (int t = tid; t < vocab; t += nt)
                if (fkey(v[t]) > K) gt += (double)kexp(v[t] - mx);
            gt = block_sum_f64(gt, shd);
            // Smallest id bound X with gt + mass{key == K, id < X} >= target.
            u32 ilo = 1, ihi = (u32)vocab;
            while (ilo < ihi) {
                u32 mid = ilo + (ihi - ilo) / 2;
                double m = 0.0;
                for (int t = tid; t < (int)mid; t += nt)
                    if (fkey(v[t]) == K) m += (double)kexp(v[t] - mx);
                m = block_sum_f64(m, shd);
                if (gt + m >= target) ihi = mid; else ilo = mid + 1;
            }
            for (int t = tid; t < vocab; t += nt) {
                u32 key = fkey(v[t]);
                if (!(key > K || (key == K && (u32)t < ilo))) v[t] = KESTREL_NEG_INF;
            }
            __syncthreads();
        }
    }

    // 4. min-p relative to the max (which every filter keeps).
    if (!greedy && P.min_p > 0.0f) {
        float floor_v = mx + logf(P.min_p);
        for (int t = tid; t < vocab; t += nt)
            if (v[t] < floor_v) v[t] = KESTREL_NEG_INF;
        __syncthreads();
    }

    // 5. The final distribution: logprob = l - (max + ln z).
    double z = 0.0;
    for (int t = tid; t < vocab; t += nt)
        if (v[t] > KESTREL_NEG_INF) z += (double)kexp(v[t] - mx);
    z = block_sum_f64(z, shd);
    const float lz = mx + (float)log(z);

    u32 token;
    if (greedy) {
        // Lowest id holding the max.
        u32 best = 0xffffffffu;
        for (int t = tid; t < vocab; t += nt)
            if (v[t] == mx) best = min(best, (u32)t);
        token = block_min_u32(best, shu);
    } else {
        // Walk in id order: each thread owns a contiguous chunk; an exclusive
        // scan of chunk masses tells each thread where its chunk starts.
        double u = uniform01(P.seed, positions[i]) * z;
        int chunk = (vocab + nt - 1) / nt;
        int a = tid * chunk, b = min(vocab, a + chunk);
        double local = 0.0;
        for (int t = a; t < b; ++t)
            if (v[t] > KESTREL_NEG_INF) local += (double)kexp(v[t] - mx);
        // Inclusive scan over threads (Hillis-Steele through shared memory).
        __shared__ double scan[SAMPLE_THREADS];
        scan[tid] = local;
        __syncthreads();
        for (int off = 1; off < nt; off <<= 1) {
            double add = tid >= off ? scan[tid - off] : 0.0;
            __syncthreads();
            scan[tid] += add;
            __syncthreads();
        }
        double acc = scan[tid] - local;
        u32 pick = 0xffffffffu, last = 0;
        bool any = false;
        for (int t = a; t < b; ++t) {
            if (v[t] > KESTREL_NEG_INF) {
                any = true;
                last = (u32)t;
                acc += (double)kexp(v[t] - mx);
                if (acc > u) {
                    pick = (u32)t;
                    break;
                }
            }
        }
        pick = block_min_u32(pick, shu);
        if (pick == 0xffffffffu) {
            // Rounding left u past the total: the CPU picks the last candidate.
            u32 inv_last = any ? ~last : 0xffffffffu;
            pick = ~block_min_u32(inv_last, shu);
        }
        token = pick;
    }
    const float lp = v[token] - lz;

    // 6. top-n alternatives, best first; rows are top_n wide.
    for (int j = 0; j < top_n; ++j) {
        float lb = KESTREL_NEG_INF;
        for (int t = tid; t < vocab; t += nt) lb = fmaxf(lb, v[t]);
        float best = block_max(lb, shf);
        u32 id = 0xffffffffu;
        if (best > KESTREL_NEG_INF)
            for (int t = tid; t < vocab; t += nt)
                if (v[t] == best) id = min(id, (u32)t);
        id = block_min_u32(id, shu);
        if (tid == 0) {
            bool ok = id != 0xffffffffu;
            out_top_ids[(size_t)i * top_n + j] = ok ? id : 0;
            out_top_lps[(size_t)i * top_n + j] = ok ? best - lz : KESTREL_NEG_INF;
            if (ok) v[id] = KESTREL_NEG_INF;
        }
        __syncthreads();
    }

    if (tid == 0) {
        out_tokens[i] = token;
        out_logprobs[i] = lp;
        pending[kv_row] = token;
        cnt[token] += 1;
    }
}

// Forget the generated-token counts of the KV rows a prefill admits.
extern "C" __global__ void reset_counts(u32* __restrict__ counts, const u32* __restrict__ rows,
                                        int vocab, int n) {
    int i = blockIdx.x;
    if (i >= n) return;
    u32* c = counts + (size_t)rows[i] * vocab;
    for (int t = threadIdx.x; t < vocab; t += blockDim.x) c[t] = 0;
}
