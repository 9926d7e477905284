/* Paged decode attention for CPU over an fp32 or bf16 KV cache (kv_type.h): each query row attends over its sequence's pages where they lie in
 * the cache, so nothing is copied (the torch path gathers every layer's K/V pages into a contiguous view
 * first, which was 39% of a decode step on SmolLM2's shape).
 *
 * Layouts (all contiguous): q and out [B, Hq, D]; k_cache and v_cache [num_pages, page_size, Hk, D];
 * block_tables [B, bt_stride] int32 page ids; context_lens [B] int32 (keys per row, >= 1).
 * scratch holds num_threads rows of Hq * (max_context rounded up to 16) floats.
 *
 * The work is split into (row, KV head) items: the Hq / Hk query heads that share one KV head need only that
 * head's K and V rows, so items are independent, and OpenMP hands them to threads. Built with -fopenmp, this
 * library needs libgomp.so.1, which torch has already loaded: the dynamic linker reuses it, so the kernel
 * runs on torch's own thread team (no second pool, no threads spinning against each other after a matmul).
 *
 * Per item, three passes, each reading memory in order: (1) every cached token's K row against each query
 * head of the group: scores s[h][t]; (2) a max-subtracted softmax per head, a contiguous loop the compiler
 * vectorizes (expf included, with -ffast-math and glibc's libmvec); (3) every token's V row added into each
 * head's output. The head dim is a compile-time constant for the common sizes (64, 128).
 *
 * Decode attention reads every cached K and V row once per layer, so it is bound by memory bandwidth; what
 * the kernel must not do is spend more than that. Rows are located with a cursor (no division per token),
 * and with AVX-512 (below) the arithmetic runs at a few instructions per score; over a bf16 cache on a CPU with
 * AVX512-BF16 and no AMX the products are bf16 dot products (attend_group_dp, which says what it rounds and why
 * not on AMX).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "kv_type.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* Walks a row's tokens in order, page by page, with no division per token (a 64-bit divide by the runtime page
 * size costs tens of cycles, about as much as the arithmetic on the row it locates). */
typedef struct {
    const int32_t *pages;
    int64_t page_size, token_stride, page, offset;
} token_cursor;

static inline __attribute__((always_inline)) int64_t next_token(token_cursor *c) {
    const int64_t at = ((int64_t)c->pages[c->page] * c->page_size + c->offset) * c->token_stride;
    if (++c->offset == c->page_size) {
        c->offset = 0;
        c->page++;
    }
    return at;
}

/* Rows are fetched this many tokens before a pass reads them: the pages of a sequence lie anywhere in the cache,
 * so the hardware prefetcher, which follows one address stream, stalls at every page boundary. On a Zen 3 EPYC
 * (AVX2) this took the portable kernel's 30 layers at 16 rows x 600 keys from 66 to 51 ms over scattered pages
 * and from 48 to 41 ms over contiguous ones (decode_attention_bench, one thread, medians of four rounds; the
 * before side built with DUET_NATIVE_CPU_CFLAGS=-DAHEAD=100000, which leaves the portable loops no row to fetch). */
#ifndef AHEAD
#define AHEAD 8
#endif

/* every 64-byte line of the n elements at row */
static inline __attribute__((always_inline)) void prefetch_row(const kv_t *row, const int64_t n) {
    for (int64_t c = 0; c < n; c += 64 / sizeof(kv_t)) __builtin_prefetch(row + c, 0, 3);
}

/* The AVX-512 loops below compute a row in a few cycles, so they fetch further ahead (AHEAD_WIDE tokens in the V
 * pass) and into L2 (`prefetcht1`) rather than L1: on a Zen 4 EPYC this took the bf16 kernel's 30 layers at 16
 * rows x 600 keys from 28.1 to 18.3 ms over contiguous pages and from 35.1 to 22.1 over scattered ones (one
 * thread, CPU time, best of 9; fetching into L1 that far ahead, or into L2 8 tokens ahead, gained less). */
#ifndef AHEAD_WIDE
#define AHEAD_WIDE 32
#endif
static inline __attribute__((always_inline)) void prefetch_row_l2(const kv_t *row, const int64_t n) {
    for (int64_t c = 0; c < n; c += 64 / sizeof(kv_t)) __builtin_prefetch(row + c, 0, 2);
}

/* the first ctx scores of each of the `heads` rows of s (row stride `stride`) become their max-subtracted
 * softmax */
static inline __attribute__((always_inline)) void softmax_rows(float *restrict s, const int64_t heads,
                                                               const int64_t ctx, const int64_t stride) {
    for (int64_t h = 0; h < heads; h++) {
        float *sh = s + h * stride;
        float m = -FLT_MAX, sum = 0.0f;
        for (int64_t t = 0; t < ctx; t++) m = sh[t] > m ? sh[t] : m;
        for (int64_t t = 0; t < ctx; t++) {
            sh[t] = expf(sh[t] - m);
            sum += sh[t];
        }
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < ctx; t++) sh[t] *= inv;
    }
}

/* One item, portable C. k and v point at KV head g's D elements within a token's row; q and out at the group's
 * first query head. */
static inline __attribute__((always_inline)) void attend_group(
    const float *restrict q, const kv_t *restrict k_cache, const kv_t *restrict v_cache,
    const int32_t *restrict pages, const int64_t ctx, float *restrict out, const int64_t kv_heads,
    const int64_t group, const int64_t d, const int64_t page_size, const int64_t token_stride, const float scale,
    float *restrict s) {
    const int64_t heads = kv_heads * group;
    token_cursor at = {pages, page_size, token_stride, 0, 0}, ahead = at;
    for (int64_t t = 0; t < AHEAD && t < ctx; t++) next_token(&ahead);
    for (int64_t t = 0; t < ctx; t++) {
        const kv_t *k = k_cache + next_token(&at);
        if (t + AHEAD < ctx) prefetch_row(k_cache + next_token(&ahead), kv_heads * d);
        for (int64_t h = 0; h < heads; h++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < d; i++) acc += q[h * d + i] * kv_float(k[(h / group) * d + i]);
            s[h * ctx + t] = scale * acc;
        }
    }
    softmax_rows(s, heads, ctx, ctx);
    memset(out, 0, sizeof(float) * heads * d);
    at = ahead = (token_cursor){pages, page_size, token_stride, 0, 0};
    for (int64_t t = 0; t < AHEAD && t < ctx; t++) next_token(&ahead);
    for (int64_t t = 0; t < ctx; t++) {
        const kv_t *v = v_cache + next_token(&at);
        if (t + AHEAD < ctx) prefetch_row(v_cache + next_token(&ahead), kv_heads * d);
        for (int64_t h = 0; h < heads; h++)
            for (int64_t i = 0; i < d; i++) out[h * d + i] += s[h * ctx + t] * kv_float(v[(h / group) * d + i]);
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* The same item with AVX-512, for head dims 64 and 128. Plain C spends most of its time outside the FMAs:
 * every (token, head) dot product ends in a horizontal sum of one vector, and pass 3 loads and stores the
 * outputs for every token. Here pass 1 takes 16 tokens at a time (16 dot products in 16 vectors, then one
 * transpose-add tree, hsum16, reduces them into one vector of 16 scores), and pass 3 keeps up to 16 vectors of
 * outputs (4 heads of 64, 2 of 128) in registers while it streams the V rows. */

/* the rows of the tokens past a sequence's end in its last block of 16: zeros */
static const kv_t zero_row[128] = {0};

/* A sequence's tokens 16 at a time (a block): `first_block` starts the cursor `at` and the first block's rows in
 * `next`; `next_block` moves them into `block` (zero_row past ctx) and fetches the next block's rows, `row`
 * elements each, into L2 while this one is computed. */
static inline __attribute__((always_inline)) void first_block(token_cursor *at, const kv_t *cache, const int64_t ctx,
                                                              const kv_t *next[16]) {
    for (int j = 0; j < 16; j++) next[j] = j < ctx ? cache + next_token(at) : zero_row;
}

static inline __attribute__((always_inline)) void next_block(token_cursor *at, const kv_t *cache, const int64_t t0,
                                                             const int64_t ctx, const int64_t row,
                                                             const kv_t *next[16], const kv_t *block[16]) {
    for (int j = 0; j < 16; j++) {
        block[j] = next[j];
        next[j] = t0 + 16 + j < ctx ? cache + next_token(at) : zero_row;
        if (next[j] != zero_row) prefetch_row_l2(next[j], row);
    }
}

/* lane j of the result is the sum of the 16 floats of a[j] */
static inline __attribute__((always_inline)) __m512 hsum16(const __m512 a[16]) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of the pair */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  /* per 128-bit lane: the lane's sum for 4 consecutive inputs */
        const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* add the four 128-bit lanes: lanes (0,2) + (1,3), twice, leaves inputs 0-3, 4-7, 8-11, 12-15 in order */
    const __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
    const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
}

/* s[0..16) = scale * q . k[j] over 16 key rows (a block's tail points at zero_row). Unrolled, so the 16 dot
 * products are independent chains of FMAs in registers rather than one chain at a time. */
static inline __attribute__((always_inline)) void scores16(const float *restrict q, const kv_t *const k[16],
                                                           const int64_t d, const float scale, float *restrict s) {
    __m512 qv[8], acc[16];
    for (int64_t c = 0; c < d / 16; c++) qv[c] = _mm512_loadu_ps(q + 16 * c);
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) acc[j] = _mm512_mul_ps(qv[0], KV_LOAD16(k[j]));
    for (int64_t c = 1; c < d / 16; c++)
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++) acc[j] = _mm512_fmadd_ps(qv[c], KV_LOAD16(k[j] + 16 * c), acc[j]);
    _mm512_storeu_ps(s, _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(scale)));
}

/* out[h] = sum_t s[h][t] v_t for `heads` query heads (a constant after inlining, so the accumulators stay in
 * registers) */
static inline __attribute__((always_inline)) void weighted_v(
    const kv_t *restrict v_cache, const int32_t *restrict pages, const int64_t ctx, const int64_t page_size,
    const int64_t token_stride, const float *restrict s, const int64_t s_stride, const int heads, const int64_t d,
    float *restrict out) {
    __m512 o[4][8];
    for (int h = 0; h < heads; h++)
        for (int64_t c = 0; c < d / 16; c++) o[h][c] = _mm512_setzero_ps();
    token_cursor at = {pages, page_size, token_stride, 0, 0}, ahead = at;
    for (int64_t t = 0; t < AHEAD_WIDE && t < ctx; t++) next_token(&ahead);
    for (int64_t t = 0; t < ctx; t++) {
        const kv_t *v = v_cache + next_token(&at);
        if (t + AHEAD_WIDE < ctx) prefetch_row_l2(v_cache + next_token(&ahead), d);
        for (int64_t c = 0; c < d / 16; c++) {
            const __m512 vc = KV_LOAD16(v + 16 * c);
            for (int h = 0; h < heads; h++) o[h][c] = _mm512_fmadd_ps(_mm512_set1_ps(s[h * s_stride + t]), vc, o[h][c]);
        }
    }
    for (int h = 0; h < heads; h++)
        for (int64_t c = 0; c < d / 16; c++) _mm512_storeu_ps(out + h * d + 16 * c, o[h][c]);
}

static inline __attribute__((always_inline)) void attend_group_avx512(
    const float *restrict q, const kv_t *restrict k_cache, const kv_t *restrict v_cache,
    const int32_t *restrict pages, const int64_t ctx, float *restrict out, const int64_t kv_heads,
    const int64_t group, const int64_t d, const int64_t page_size, const int64_t token_stride, const float scale,
    float *restrict s) {
    /* scores, 16 tokens a block, in rows of cs floats (room for a whole last block); the next block's K rows are
     * fetched (into L2) while this one is computed */
    const int64_t cs = (ctx + 15) / 16 * 16;
    token_cursor at = {pages, page_size, token_stride, 0, 0};
    const kv_t *k[16], *kg[16], *next[16];
    first_block(&at, k_cache, ctx, next);
    for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
        next_block(&at, k_cache, t0, ctx, kv_heads * d, next, k);
        for (int64_t g = 0; g < kv_heads; g++) {
            for (int j = 0; j < 16; j++) kg[j] = k[j] == zero_row ? zero_row : k[j] + g * d;
            for (int64_t h = g * group; h < (g + 1) * group; h++) scores16(q + h * d, kg, d, scale, s + h * cs + t0);
        }
    }
    softmax_rows(s, kv_heads * group, ctx, cs);
    const int most = d == 64 ? 4 : 2;  /* heads whose outputs fit in 16 vector registers */
    for (int64_t g = 0; g < kv_heads; g++)
        for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += most) {
            const int heads = (g + 1) * group - h0 < most ? (int)((g + 1) * group - h0) : most;
            const kv_t *vg = v_cache + g * d;
            const float *sh = s + h0 * cs;
            float *oh = out + h0 * d;
            switch (heads) {
            case 1: weighted_v(vg, pages, ctx, page_size, token_stride, sh, cs, 1, d, oh); break;
            case 2: weighted_v(vg, pages, ctx, page_size, token_stride, sh, cs, 2, d, oh); break;
            case 3: weighted_v(vg, pages, ctx, page_size, token_stride, sh, cs, 3, d, oh); break;
            default: weighted_v(vg, pages, ctx, page_size, token_stride, sh, cs, 4, d, oh); break;
            }
        }
}

/* Not in the AMX build: on the AMX Xeon measured (family 6 model 167) the widen-and-FMA path above was the faster,
 * this one 1.07-1.17x its time (decode_attention_bench --against, 2 threads, 2 x 600, 16 x 600 and 5 x 2,800 keys,
 * contiguous and scattered pages; docs/benchmarks.md), where a Zen 4 ran this one at 0.82-0.96x. */
#if defined(KV_BF16) && defined(__AVX512BF16__) && !defined(__AMX_TILE__)
/* AVX512-BF16 (AMD Zen 4 and 5, Intel from Cooper Lake on), bf16 KV cache, head dims 64 and 128: both passes with
 * `vdpbf16ps`, two multiply-adds per fp32 lane that read bf16 operands as they are. The widen-and-FMA path above
 * spends three instructions per 16 products (widen: two; FMA: one), which a Zen 4 runs at half width: it streamed
 * K/V at about 12 GB/s of the core's 30 (docs/benchmarks.md), bound by arithmetic, not memory. Here a score is two
 * dot-product instructions (d = 64) and its share of one hsum16, and the weighted sum of V takes two tokens per
 * instruction. The query and the probabilities are rounded to bf16 (a bf16 model's query is bf16 already; the
 * probabilities' rounding is 2^-9 relative, as in the extend kernel's dot products and the GPU kernels that keep P
 * in bf16); scores, softmax and outputs stay fp32.
 *
 * The V pass walks the tokens once, a block of 16 at a time, every KV head of a token's row in turn, so each V row
 * is read once and in order (the path above walks all tokens once per KV head, each time 1 / kv_heads of every
 * row). */

/* s[0..16) = scale * q . k[j] over 16 key rows, also returned: qb the query as bf16 pairs of dims (d / 32 vectors) */
static inline __attribute__((always_inline)) __m512 scores16_dp(const __m512bh *restrict qb, const kv_t *const k[16],
                                                                const int64_t d, const float scale, float *restrict s) {
    __m512 acc[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++)
        acc[j] = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(k[j]), qb[0]);
    for (int64_t c = 1; c < d / 32; c++)
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++)
            acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_loadu_si512(k[j] + 32 * c), qb[c]);
    const __m512 out = _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(scale));
    _mm512_storeu_ps(s, out);
    return out;
}

/* o[h] += sum over 16 tokens of p[h][t] v_t for `heads` query heads (a constant after inlining: the outputs stay in
 * registers for the block): v[16] the tokens' rows at this KV head, pp[h] the heads' probabilities as bf16 pairs of
 * tokens (pp_stride apart), o [heads][d] fp32 with the dims of each 32 in the order `finish_outputs` (below) undoes. Two tokens' rows
 * are interleaved into pairs with the in-lane unpacks (one cheap instruction each; a full interleave is a slower
 * cross-lane permute), which leave the dims of each 32 in the order the final store undoes. */
static inline __attribute__((always_inline)) void weighted_v16_dp(const kv_t *const v[16],
                                                                  const uint32_t *restrict pp, const int64_t pp_stride,
                                                                  const int heads, const int64_t d, float *restrict o) {
    __m512 acc[4][8];
    for (int h = 0; h < heads; h++)
        for (int64_t c = 0; c < d / 16; c++) acc[h][c] = _mm512_loadu_ps(o + h * d + 16 * c);
    for (int j = 0; j < 16; j += 2) {
        __m512i x[8];
        for (int64_t c = 0; c < d / 32; c++) {
            const __m512i a = _mm512_loadu_si512(v[j] + 32 * c), b = _mm512_loadu_si512(v[j + 1] + 32 * c);
            x[2 * c] = _mm512_unpacklo_epi16(a, b);
            x[2 * c + 1] = _mm512_unpackhi_epi16(a, b);
        }
        for (int h = 0; h < heads; h++) {
            const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pp[h * pp_stride + j / 2]);
            for (int64_t c = 0; c < d / 16; c++) acc[h][c] = _mm512_dpbf16_ps(acc[h][c], (__m512bh)x[c], w);
        }
    }
    for (int h = 0; h < heads; h++)
        for (int64_t c = 0; c < d / 16; c++) _mm512_storeu_ps(o + h * d + 16 * c, acc[h][c]);
}

/* The unpacks' order undone, and each head's output divided by its softmax sum: each 32 dims of o were accumulated
 * as [the unpacklo lanes | the unpackhi lanes], lane L of 128 bits holding dims 8L .. 8L + 3 (lo) and 8L + 4 .. 8L + 7
 * (hi) */
static inline __attribute__((always_inline)) void finish_outputs(float *restrict o, const int64_t heads, const int64_t d,
                                                                 const float *restrict sum) {
    const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0),
                  second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    for (int64_t h = 0; h < heads; h++) {
        const __m512 inv = _mm512_set1_ps(1.0f / sum[h]);
        for (float *oc = o + h * d; oc < o + (h + 1) * d; oc += 32) {
            const __m512 lo = _mm512_loadu_ps(oc), hi = _mm512_loadu_ps(oc + 16);
            _mm512_storeu_ps(oc, _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), inv));
            _mm512_storeu_ps(oc + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), inv));
        }
    }
}

static inline __attribute__((always_inline)) void attend_group_dp(
    const float *restrict q, const kv_t *restrict k_cache, const kv_t *restrict v_cache,
    const int32_t *restrict pages, const int64_t ctx, float *restrict out, const int64_t kv_heads,
    const int64_t group, const int64_t d, const int64_t page_size, const int64_t token_stride, const float scale,
    float *restrict s) {
    const int64_t heads = kv_heads * group, cs = (ctx + 15) / 16 * 16, row = kv_heads * d;
    __m512bh qb[heads * (d / 32)]; /* the query heads as bf16 pairs of dims */
    for (int64_t h = 0; h < heads; h++)
        for (int64_t c = 0; c < d / 32; c++)
            qb[h * (d / 32) + c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + h * d + 32 * c + 16),
                                                       _mm512_loadu_ps(q + h * d + 32 * c));
    /* pass 1: scores, 16 tokens a block, in rows of cs floats, and each head's running max (lanes past ctx left
     * out); the next block's K rows fetched into L2 meanwhile */
    __m512 mx[heads];
    for (int64_t h = 0; h < heads; h++) mx[h] = _mm512_set1_ps(-FLT_MAX);
    token_cursor at = {pages, page_size, token_stride, 0, 0};
    const kv_t *k[16], *kg[16], *next[16];
    first_block(&at, k_cache, ctx, next);
    for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
        next_block(&at, k_cache, t0, ctx, row, next, k);
        const __mmask16 real = ctx - t0 >= 16 ? 0xFFFF : (__mmask16)((1u << (ctx - t0)) - 1);
        for (int64_t g = 0; g < kv_heads; g++) {
            for (int j = 0; j < 16; j++) kg[j] = k[j] == zero_row ? zero_row : k[j] + g * d;
            for (int64_t h = g * group; h < (g + 1) * group; h++)
                mx[h] = _mm512_mask_max_ps(mx[h], real, mx[h], scores16_dp(qb + h * (d / 32), kg, d, scale,
                                                                               s + h * cs + t0));
        }
    }
    /* one pass per head: exp(score - max), its sum, and the probabilities as bf16 pairs of tokens in the first half
     * of the head's own row of s (each 32 floats are read before their 16 pairs are written, at or before them),
     * zeros past ctx; the outputs are divided by the sums at the end */
    float sum[heads];
    for (int64_t h = 0; h < heads; h++) {
        float *sh = s + h * cs;
        const float m = _mm512_reduce_max_ps(mx[h]);
        float total = 0.0f;
        for (int64_t t0 = 0; t0 < cs; t0 += 32) {
            float e[32] __attribute__((aligned(64)));
            const int64_t n = ctx - t0 < 32 ? ctx - t0 : 32;
            for (int i = 0; i < 32; i++) e[i] = i < n ? expf(sh[t0 + i] - m) : 0.0f;
            for (int i = 0; i < 32; i++) total += e[i];
            _mm512_storeu_si512(sh + t0 / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(e + 16), _mm512_load_ps(e)));
        }
        sum[h] = total;
    }
    /* pass 2: the weighted sum of V, the same blocks, every KV head of a block before the next */
    const int most = d == 64 ? 4 : 2; /* heads whose outputs fit in 16 vector registers */
    memset(out, 0, sizeof(float) * heads * d);
    at = (token_cursor){pages, page_size, token_stride, 0, 0};
    const kv_t *v[16], *vg[16];
    first_block(&at, v_cache, ctx, next);
    for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
        next_block(&at, v_cache, t0, ctx, row, next, v);
        for (int64_t g = 0; g < kv_heads; g++) {
            for (int j = 0; j < 16; j++) vg[j] = v[j] == zero_row ? zero_row : v[j] + g * d;
            for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += most) {
                const int n = (g + 1) * group - h0 < most ? (int)((g + 1) * group - h0) : most;
                const uint32_t *pp = (const uint32_t *)(s + h0 * cs) + t0 / 2;
                float *oh = out + h0 * d;
                switch (n) {
                case 1: weighted_v16_dp(vg, pp, cs, 1, d, oh); break;
                case 2: weighted_v16_dp(vg, pp, cs, 2, d, oh); break;
                case 3: weighted_v16_dp(vg, pp, cs, 3, d, oh); break;
                default: weighted_v16_dp(vg, pp, cs, 4, d, oh); break;
                }
            }
        }
    }
    finish_outputs(out, heads, d, sum);
}
#define ATTEND_FAST attend_group_dp
#else
#define ATTEND_FAST attend_group_avx512
#endif
#else
#define ATTEND_FAST attend_group
#endif

void KV_NAME(paged_decode)(const float *q, const kv_t *k_cache, const kv_t *v_cache, const int32_t *block_tables,
                      int64_t bt_stride, const int32_t *context_lens, float *out, int64_t num_rows,
                      int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, int64_t page_size, float scale,
                      float *scratch, int64_t scratch_stride, int64_t num_threads) {
    const int64_t group = num_q_heads / num_kv_heads, token_stride = num_kv_heads * head_dim;
    /* An item is a row with all its KV heads, which reads each token's K and V rows whole and in order; with
     * fewer rows than threads, an item is one KV head of a row, so a single sequence still uses every core. */
    const int64_t per_item = num_rows >= num_threads ? num_kv_heads : 1, items_per_row = num_kv_heads / per_item;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t item = 0; item < num_rows * items_per_row; item++) {
        const int64_t b = item / items_per_row, g = (item % items_per_row) * per_item;
#ifdef _OPENMP
        float *s = scratch + omp_get_thread_num() * scratch_stride;
#else
        float *s = scratch;
#endif
        const float *qg = q + (b * num_q_heads + g * group) * head_dim;
        float *og = out + (b * num_q_heads + g * group) * head_dim;
        const kv_t *kg = k_cache + g * head_dim, *vg = v_cache + g * head_dim;
        const int32_t *pages = block_tables + b * bt_stride;
        const int64_t ctx = context_lens[b];
        if (head_dim == 64)
            ATTEND_FAST(qg, kg, vg, pages, ctx, og, per_item, group, 64, page_size, token_stride, scale, s);
        else if (head_dim == 128)
            ATTEND_FAST(qg, kg, vg, pages, ctx, og, per_item, group, 128, page_size, token_stride, scale, s);
        else
            attend_group(qg, kg, vg, pages, ctx, og, per_item, group, head_dim, page_size, token_stride, scale, s);
    }
}
