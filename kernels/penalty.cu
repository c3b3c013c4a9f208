// penalty.cu: the generated-token counts a re-admitted sequence brings back.
// A sequence preempted after sampling some tokens is prefilled again over
// its prompt and those tokens; its KV row's counts (zeroed by reset_counts)
// must count them as if the row had sampled them, so the repetition,
// frequency and presence penalties of its next tokens are the CPU's.
// Grid (n), one block per re-admitted row; integer atomics, so the order of
// the additions does not matter. Ids past the vocabulary are skipped.

extern "C" __global__ void count_tokens(u32* __restrict__ counts, const u32* __restrict__ rows,
                                        const u32* __restrict__ indptr,
                                        const u32* __restrict__ tokens, int vocab, int n) {
    int i = blockIdx.x;
    if (i >= n) return;
    u32* c = counts + (size_t)rows[i] * vocab;
    for (u32 t = indptr[i] + threadIdx.x; t < indptr[i + 1]; t += blockDim.x) {
        u32 tok = tokens[t];
        if (tok < (u32)vocab) atomicAdd(c + tok, 1u);
    }
}
