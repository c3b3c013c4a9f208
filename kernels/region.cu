// region.cu: Moondream's spatial stage on the device (docs/moondream.md,
// "Region model" and "Spatial decode in the step"), around the region
// MLPs' matmuls (the runtime's GEMMs, biases by `add_bias`, GELU by
// `bias_gelu`):
// - `spatial_values`: after sampling, per row, the value its sampled token
//   means: the coordinate decoder's argmax (first maximum; a NaN counts as
//   the largest, as `torch.argmax`) as `bin / bins` for `coord_id`, the
//   size decoder's two argmaxes through `size_table` (`2^((bin / (bins -
//   1)) * 10 - 10)`, computed once on the host by kestrel-cpu's formula,
//   so no transcendental differs by device) for `size_id`, zeros
//   otherwise; into the step's output `[n][3]` (coord, w, h) and the row's
//   KV row of `pending` values (the next step's input, device-side).
// - `fourier_features`: each row's pending values as the encoders' inputs
//   `[cos(2 pi v W), sin(2 pi v W)]` (f16, the GEMM's input), for the
//   coordinate and the size alike (a captured graph cannot branch on a
//   sampled token; `spatial_embed` picks).
// - `spatial_embed`: the rows whose input token is `coord_id` / `size_id`
//   take their encoder's output row instead of the token embedding.
// - `hidden_f16`: the decoders' input rows (the f32 residual stream to f16).
// - `accept_values`: a verifying step's members' pending values, from the
//   row whose token `accept_drafts` made their pending token.

// Whether (bv, bi) comes before (av, ai) in argmax order: a NaN first, then
// the larger value, then the lower index; index -1 is "none" (last).
__device__ __forceinline__ bool argmax_before(float bv, int bi, float av, int ai) {
    if (bi < 0) return false;
    if (ai < 0) return true;
    bool an = av != av, bn = bv != bv;
    if (an || bn) return an && bn ? bi < ai : bn;
    return bv > av || (bv == av && bi < ai);
}

// The argmax of v[0..len) over the block (every thread gets it); `sv`/`si`
// hold blockDim.x entries. The order is total, so the result does not
// depend on how the block splits the row.
__device__ int block_argmax(const float* __restrict__ v, int len, float* sv, int* si) {
    float bv = 0.0f;
    int bi = -1;
    for (int j = threadIdx.x; j < len; j += blockDim.x)
        if (argmax_before(v[j], j, bv, bi)) {
            bv = v[j];
            bi = j;
        }
    sv[threadIdx.x] = bv;
    si[threadIdx.x] = bi;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int t = 1; t < (int)blockDim.x; t++)
            if (argmax_before(sv[t], si[t], bv, bi)) {
                bv = sv[t];
                bi = si[t];
            }
        si[0] = bi;
    }
    __syncthreads();
    int r = si[0];
    __syncthreads();
    return r;
}

#define SPATIAL_THREADS 256

// One block of SPATIAL_THREADS per row. `coord_logits` rows hold
// `coord_bins`, `size_logits` rows `2 * size_bins` (width, then height);
// `tokens[i]` is row i's sampled token; `rows` (null: none) its KV row,
// whose `pending` values (3 floats) are rewritten too.
extern "C" __global__ void __launch_bounds__(SPATIAL_THREADS) spatial_values(
    const float* __restrict__ coord_logits, int coord_bins,
    const float* __restrict__ size_logits, int size_bins,
    const float* __restrict__ size_table, const u32* __restrict__ tokens,
    const u32* __restrict__ rows, u32 coord_id, u32 size_id, float* __restrict__ values,
    float* __restrict__ pending, int n) {
    __shared__ float sv[SPATIAL_THREADS];
    __shared__ int si[SPATIAL_THREADS];
    int i = blockIdx.x;
    if (i >= n) return;
    u32 t = tokens[i];
    float v[3] = {0.0f, 0.0f, 0.0f};
    if (t == coord_id) {
        int bin = block_argmax(coord_logits + (size_t)i * coord_bins, coord_bins, sv, si);
        v[0] = __fdiv_rn((float)bin, (float)coord_bins);
    } else if (t == size_id) {
        const float* row = size_logits + (size_t)i * 2 * size_bins;
        v[1] = size_table[block_argmax(row, size_bins, sv, si)];
        v[2] = size_table[block_argmax(row + size_bins, size_bins, sv, si)];
    }
    if (threadIdx.x < 3) {
        values[(size_t)i * 3 + threadIdx.x] = v[threadIdx.x];
        if (rows) pending[(size_t)rows[i] * 3 + threadIdx.x] = v[threadIdx.x];
    }
}

// Row i's values are `values[(rows ? rows[i] : i) * 3 ..]` (coord, w, h);
// `coord_w` holds `coord_half` frequencies, `size_w` `[2][size_half]`.
// Writes `coord_feats[n][2 coord_half]` and `size_feats[n][2 size_half]`
// (cos half, then sin half), as kestrel-cpu's `region::fourier_features`:
// the angle is `(2 pi * v) * w` (a size's two terms added in input order).
extern "C" __global__ void fourier_features(const float* __restrict__ values,
                                            const u32* __restrict__ rows,
                                            const float* __restrict__ coord_w, int coord_half,
                                            const float* __restrict__ size_w, int size_half,
                                            h16* __restrict__ coord_feats,
                                            h16* __restrict__ size_feats, int n) {
    const float two_pi = 6.2831855f;
    int per_row = coord_half + size_half;
    size_t total = (size_t)n * per_row;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (size_t)gridDim.x * blockDim.x) {
        int i = (int)(idx / per_row), k = (int)(idx % per_row);
        const float* v = values + (size_t)(rows ? rows[i] : (u32)i) * 3;
        if (k < coord_half) {
            float a = __fmul_rn(__fmul_rn(two_pi, v[0]), coord_w[k]);
            h16* o = coord_feats + (size_t)i * 2 * coord_half;
            o[k] = f2h(cosf(a));
            o[coord_half + k] = f2h(sinf(a));
        } else {
            k -= coord_half;
            float a = __fadd_rn(__fmul_rn(__fmul_rn(two_pi, v[1]), size_w[k]),
                                __fmul_rn(__fmul_rn(two_pi, v[2]), size_w[size_half + k]));
            h16* o = size_feats + (size_t)i * 2 * size_half;
            o[k] = f2h(cosf(a));
            o[size_half + k] = f2h(sinf(a));
        }
    }
}

// Row i of `x` (`hidden` f32) becomes `coord_emb` row i when its input
// token (`tokens[rows ? rows[i] : i]`) is `coord_id`, `size_emb` row i when
// it is `size_id`; other rows keep their token embedding.
extern "C" __global__ void spatial_embed(float* __restrict__ x, const float* __restrict__ coord_emb,
                                         const float* __restrict__ size_emb,
                                         const u32* __restrict__ tokens,
                                         const u32* __restrict__ rows, u32 coord_id,
                                         u32 size_id, int hidden, int n) {
    int i = blockIdx.x;
    if (i >= n) return;
    u32 t = tokens[rows ? rows[i] : (u32)i];
    const float* src = t == coord_id ? coord_emb : t == size_id ? size_emb : nullptr;
    if (!src) return;
    for (int j = threadIdx.x; j < hidden; j += blockDim.x)
        x[(size_t)i * hidden + j] = src[(size_t)i * hidden + j];
}

// The hidden state the region decoders read (the residual stream after
// the last block, before the final norm) as f16 GEMM rows: row i of `x` to
// row `out_row[i]` of `out` (negative: none; null: identity), as the final
// norm routes a prefill's sampled rows.
extern "C" __global__ void hidden_f16(const float* __restrict__ x, const int* __restrict__ out_row,
                                      h16* __restrict__ out, int hidden, int n) {
    int i = blockIdx.x;
    if (i >= n) return;
    int o = out_row ? out_row[i] : i;
    if (o < 0) return;
    for (int j = threadIdx.x; j < hidden; j += blockDim.x)
        out[(size_t)o * hidden + j] = f2h(x[(size_t)i * hidden + j]);
}

// After `accept_drafts` of a verifying step: member i's pending values are
// those of its last accepted row (`values[qo[i] + accepted[i] - 1]`), as
// its pending token is that row's sampled token.
extern "C" __global__ void accept_values(const u32* __restrict__ qo,
                                         const u32* __restrict__ accepted,
                                         const u32* __restrict__ kv_rows,
                                         const float* __restrict__ values,
                                         float* __restrict__ pending, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float* v = values + (size_t)(qo[i] + accepted[i] - 1) * 3;
    float* p = pending + (size_t)kv_rows[i] * 3;
    for (int k = 0; k < 3; k++) p[k] = v[k];
}
