/* Paged decode attention for CPU, fp32: each query row attends over its sequence's pages where they lie in
 * the cache, so nothing is copied (the torch path gathers every layer's K/V pages into a contiguous view
 * first, which was 39% of a decode step on SmolLM2's shape).
 *
 * Layouts (all contiguous): q and out [B, Hq, D]; k_cache and v_cache [num_pages, page_size, Hk, D];
 * block_tables [B, bt_stride] int32 page ids; context_lens [B] int32 (keys per row, >= 1).
 * Rows [row_begin, row_end) are computed, so callers can split a batch over threads (ctypes releases the
 * GIL during the call). scratch holds Hq * max_context floats.
 *
 * Per row, three passes, each reading memory in order: (1) for every cached token, its whole K row (all Hk
 * heads, contiguous) against every query head: scores s[hq][t]; (2) a max-subtracted softmax per query head,
 * a contiguous loop the compiler vectorizes (expf included, with -ffast-math and glibc's libmvec); (3) for
 * every token, its V row added into every head's output, which stays in L1. The head dim is a compile-time
 * constant for the common sizes (64, 128), so the dot products unroll into a few vector FMAs.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline __attribute__((always_inline)) float dot(const float *restrict a, const float *restrict b,
                                                       const int64_t n) {
    float acc = 0.0f;
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

static inline __attribute__((always_inline)) void axpy(float *restrict y, const float w,
                                                       const float *restrict x, const int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += w * x[i];
}

/* Pages lie anywhere in the cache, so the hardware prefetcher, which follows one address stream, stalls at
 * every page boundary (at page 16, pages scattered as a busy pool hands them out measured 1.3x slower than
 * contiguous ones: loadtests/profiles/decode_attention_bench.py). Each K row is fetched AHEAD tokens before the
 * first pass reads it, and its V row with it, for the third pass. */
#define AHEAD 8
static inline __attribute__((always_inline)) void prefetch_row(const float *k_cache, const float *v_cache,
                                                               const int32_t *pages, const int64_t t,
                                                               const int64_t page_size, const int64_t token_stride) {
    const int64_t at = ((int64_t)pages[t / page_size] * page_size + t % page_size) * token_stride;
    for (int64_t i = 0; i < token_stride; i += 16) {  /* one 64-byte line per 16 floats */
        __builtin_prefetch(k_cache + at + i, 0, 3);
        __builtin_prefetch(v_cache + at + i, 0, 1);
    }
}

static inline __attribute__((always_inline)) void attend_row(
    const float *restrict q, const float *restrict k_cache, const float *restrict v_cache,
    const int32_t *restrict pages, const int64_t ctx, float *restrict out, const int64_t hq, const int64_t hk,
    const int64_t d, const int64_t page_size, const float scale, float *restrict s) {
    const int64_t group = hq / hk;
    const int64_t token_stride = hk * d;
    for (int64_t t = 0; t < ctx; t++) {
        const float *k = k_cache + ((int64_t)pages[t / page_size] * page_size + t % page_size) * token_stride;
        if (t + AHEAD < ctx) prefetch_row(k_cache, v_cache, pages, t + AHEAD, page_size, token_stride);
        for (int64_t h = 0; h < hq; h++) s[h * ctx + t] = scale * dot(q + h * d, k + (h / group) * d, d);
    }
    for (int64_t h = 0; h < hq; h++) {
        float *sh = s + h * ctx;
        float m = -FLT_MAX, sum = 0.0f;
        for (int64_t t = 0; t < ctx; t++) m = sh[t] > m ? sh[t] : m;
        for (int64_t t = 0; t < ctx; t++) {
            sh[t] = expf(sh[t] - m);
            sum += sh[t];
        }
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < ctx; t++) sh[t] *= inv;
    }
    memset(out, 0, sizeof(float) * hq * d);
    for (int64_t t = 0; t < ctx; t++) {
        const float *v = v_cache + ((int64_t)pages[t / page_size] * page_size + t % page_size) * token_stride;
        for (int64_t h = 0; h < hq; h++) axpy(out + h * d, s[h * ctx + t], v + (h / group) * d, d);
    }
}

void paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                      int64_t bt_stride, const int32_t *context_lens, float *out, int64_t row_begin,
                      int64_t row_end, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                      int64_t page_size, float scale, float *scratch) {
    for (int64_t b = row_begin; b < row_end; b++) {
        const float *qb = q + b * num_q_heads * head_dim;
        float *ob = out + b * num_q_heads * head_dim;
        const int32_t *pages = block_tables + b * bt_stride;
        const int64_t ctx = context_lens[b];
        if (head_dim == 64)
            attend_row(qb, k_cache, v_cache, pages, ctx, ob, num_q_heads, num_kv_heads, 64, page_size, scale,
                       scratch);
        else if (head_dim == 128)
            attend_row(qb, k_cache, v_cache, pages, ctx, ob, num_q_heads, num_kv_heads, 128, page_size, scale,
                       scratch);
        else
            attend_row(qb, k_cache, v_cache, pages, ctx, ob, num_q_heads, num_kv_heads, head_dim, page_size,
                       scale, scratch);
    }
}
