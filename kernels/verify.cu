// verify.cu: speculative verification around sample_rows. A decode step
// whose member i proposes drafts d_1..d_m runs one forward over the member's
// input token and its drafts (query rows qo[i]..qo[i + 1], positions
// p..p+m, the tiled prefill_attention) and samples every row; row j must be
// sampled as decoding would after t_0..t_{j-1} = d_1..d_j, so:
//   verify_inputs  the forward's tokens: pending[kv_row], then the drafts;
//   draft_counts   per row, the member's penalty counts plus d_1..d_j, in a
//                  scratch row sample_rows reads (and bumps) instead of the
//                  member's own;
//   accept_drafts  per member, after sample_rows: accept while the token
//                  sampled at row j equals d_{j+1}; the member's pending
//                  token and counts get what decoding would have left.
// The draft tokens sit in `tokens` at each member's rows 1..=m
// (qo[i] + 1 + j), as verify_inputs wrote them. Ids past the vocabulary
// are not counted (sample_rows never returns one).

extern "C" __global__ void verify_inputs(const u32* __restrict__ pending,
                                         const u32* __restrict__ kv_rows,
                                         const u32* __restrict__ qo,
                                         const u32* __restrict__ drafts,
                                         u32* __restrict__ tokens, int n) {
    int i = blockIdx.x;
    if (i >= n) return;
    u32 a = qo[i], b = qo[i + 1];
    // Member i's drafts start after the earlier members' (qo[i] - i of them).
    for (u32 r = a + threadIdx.x; r < b; r += blockDim.x)
        tokens[r] = r == a ? pending[kv_rows[i]] : drafts[r - 1 - i];
}

// Grid (n, rows of the longest member): block (i, j) fills scratch row
// qo[i] + j.
extern "C" __global__ void draft_counts(const u32* __restrict__ counts,
                                        const u32* __restrict__ kv_rows,
                                        const u32* __restrict__ qo,
                                        const u32* __restrict__ tokens,
                                        u32* __restrict__ scratch, int vocab, int n) {
    int i = blockIdx.x, j = blockIdx.y;
    if (i >= n || qo[i] + j >= qo[i + 1]) return;
    const u32* src = counts + (size_t)kv_rows[i] * vocab;
    u32* dst = scratch + (size_t)(qo[i] + j) * vocab;
    for (int t = threadIdx.x; t < vocab; t += blockDim.x) {
        u32 c = src[t];
        for (int k = 1; k <= j; ++k) c += tokens[qo[i] + k] == (u32)t ? 1u : 0u;
        dst[t] = c;
    }
}

extern "C" __global__ void accept_drafts(const u32* __restrict__ qo,
                                         const u32* __restrict__ tokens,
                                         const u32* __restrict__ sampled,
                                         const u32* __restrict__ kv_rows,
                                         u32* __restrict__ counts, u32* __restrict__ pending,
                                         u32* __restrict__ accepted, int vocab, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    u32 a = qo[i], m = qo[i + 1] - a - 1, k = 0;
    while (k < m && sampled[a + k] == tokens[a + 1 + k]) ++k;
    u32* c = counts + (size_t)kv_rows[i] * vocab;
    for (u32 r = 0; r <= k; ++r)
        if (sampled[a + r] < (u32)vocab) c[sampled[a + r]] += 1;
    pending[kv_rows[i]] = sampled[a + k];
    accepted[i] = k + 1;
}
