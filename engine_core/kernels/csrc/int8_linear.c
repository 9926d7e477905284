/* int8 weight-only linear layer for CPU: y[M, N] = bf16(x)[M, K] . q[N, K]^T * scale[N] + bias[N].
 *
 * Why: with `--quantization int8` every matmul of a step reads a quarter of fp32's weight bytes, but torch's only
 * CPU kernel for it (`torch._weight_int8pack_mm`) runs no faster than the fp32 GEMM at decode sizes and at 0.4x
 * at prefill sizes. Where the CPU has AVX512_BF16 (Zen 4 and later, Cooper Lake and later Xeons), one
 * `vdpbf16ps` does two multiply-adds per fp32 lane, twice an fp32 FMA's work; int8 weights are exact in bf16,
 * so widening them in registers loses nothing, and the activations are rounded to bf16 once per call, as torch's
 * kernel does. The sums are fp32.
 *
 * Layouts: x [M, K] fp32, row-major (row stride x_stride floats); the weight packed at load (cpu_linear.py) as
 * [Np / 16][Kp / 2][16][2] int8: panel p, K pair j, output column c, element e holds q[16p + c][2j + e], with N
 * padded to Np (a multiple of 16) and K to Kp (even) by zero weights; scale [N]; bias [N] or NULL; y [M, N].
 * Each call allocates its own scratch: the rows rounded to bf16 (M x Kp) and one widened panel per thread.
 *
 * Work: threads split the 16-column panels; a panel runs every tile of up to 16 rows, each tile keeping its
 * 16 x 16 sums in registers over the whole K. Per K pair a panel's 32 weights are widened (int8 -> int32 -> fp32
 * -> bf16: 5 instructions) and multiplied into up to 16 rows (`vdpbf16ps`, the row's pair broadcast). A call of
 * one tile (decode) widens in registers; with more tiles (prefill) the panel is widened once into a per-thread
 * buffer (K x 64 bytes) that every tile then reads.
 *
 * Without AVX512_BF16 the portable loop below computes the same sums one by one (the tests hold both to the same
 * reference); cpu_linear.py then keeps torch's kernel, which is faster than the portable loop.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#define PANEL 16
#define ROW_TILE 16

/* fp32 -> bf16, round to nearest even (finite inputs), as vcvtneps2bf16 does */
static inline uint16_t to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    bits += 0x7fff + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

static inline float from_bf16(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

int int8_linear_vector_path(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

#ifdef __AVX512BF16__
/* the 32 int8 weights of one panel's K pair, widened to bf16 in the same order */
static inline __attribute__((always_inline)) __m512bh widen(const int8_t *w) {
    const __m128i lo = _mm_loadu_si128((const __m128i *)w), hi = _mm_loadu_si128((const __m128i *)(w + 16));
    const __m512 flo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo));
    const __m512 fhi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
    return _mm512_cvtne2ps_pbh(fhi, flo);
}

/* a panel's weights, all K pairs widened to bf16 once, for a call with several row tiles to reuse */
static void widen_panel(const int8_t *panel, const int64_t kp, __m512bh *out) {
    for (int64_t j = 0; j < kp / 2; j++) out[j] = widen(panel + j * 2 * PANEL);
}

/* rows [m0, m0 + rows) x one panel: from its int8 weights (`wide` NULL) or its widened copy. `rows` is a
 * compile-time constant at every call (the switch below), so the sums stay in registers. */
static inline __attribute__((always_inline)) void tile(const int rows, const uint16_t *xb, const int64_t kp,
                                                       const int8_t *panel, const __m512bh *wide,
                                                       const float *scale, const float *bias, float *y,
                                                       const int64_t n, const int64_t n0) {
    __m512 acc[ROW_TILE];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t j = 0; j < kp / 2; j++) {
        const __m512bh w = wide ? wide[j] : widen(panel + j * 2 * PANEL);
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            memcpy(&pair, xb + r * kp + 2 * j, 4);
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(pair), w);
        }
    }
    const int64_t width = n - n0 < PANEL ? n - n0 : PANEL;
    const __mmask16 mask = (__mmask16)((1u << width) - 1);
    const __m512 s = _mm512_maskz_loadu_ps(mask, scale + n0);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) _mm512_mask_storeu_ps(y + r * n + n0, mask, _mm512_fmadd_ps(acc[r], s, b));
}

#define TILE_CASE(R) case R: tile(R, xb, kp, panel, wide, scale, bias, y, n, n0); break;

static void run_tile(const int rows, const uint16_t *xb, const int64_t kp, const int8_t *panel,
                     const __m512bh *wide, const float *scale, const float *bias, float *y, const int64_t n,
                     const int64_t n0) {
    switch (rows) {
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6) TILE_CASE(7) TILE_CASE(8)
        TILE_CASE(9) TILE_CASE(10) TILE_CASE(11) TILE_CASE(12) TILE_CASE(13) TILE_CASE(14) TILE_CASE(15)
        TILE_CASE(16)
    }
}

/* one panel over every row tile: widened once where more than one tile reads it */
static void run_panel(const uint16_t *xb, const int64_t m, const int64_t kp, const int8_t *panel,
                      __m512bh *wide, const float *scale, const float *bias, float *y, const int64_t n,
                      const int64_t n0) {
    if (m > ROW_TILE) widen_panel(panel, kp, wide);
    for (int64_t m0 = 0; m0 < m; m0 += ROW_TILE) {
        const int rows = (int)(m - m0 < ROW_TILE ? m - m0 : ROW_TILE);
        run_tile(rows, xb + m0 * kp, kp, panel, m > ROW_TILE ? wide : NULL, scale, bias, y + m0 * n, n, n0);
    }
}
#else
typedef struct { uint16_t v[2 * PANEL]; } wide_pair; /* unused by the portable loop */

/* portable: the same sums in the same precision (bf16 products summed in fp32), one output at a time */
static void run_panel(const uint16_t *xb, const int64_t m, const int64_t kp, const int8_t *panel,
                      wide_pair *wide, const float *scale, const float *bias, float *y, const int64_t n,
                      const int64_t n0) {
    (void)wide;
    const int64_t width = n - n0 < PANEL ? n - n0 : PANEL;
    for (int64_t r = 0; r < m; r++)
        for (int64_t c = 0; c < width; c++) {
            float sum = 0.0f;
            for (int64_t j = 0; j < kp / 2; j++) {
                const int8_t *w = panel + j * 2 * PANEL + 2 * c;
                sum += from_bf16(xb[r * kp + 2 * j]) * w[0] + from_bf16(xb[r * kp + 2 * j + 1]) * w[1];
            }
            y[r * n + n0 + c] = sum * scale[n0 + c] + (bias ? bias[n0 + c] : 0.0f);
        }
}
#endif

#ifdef __AVX512BF16__
#define WIDE_TYPE __m512bh
#else
#define WIDE_TYPE wide_pair
#endif

/* Returns 0, or -1 when the scratch could not be allocated (nothing written). */
int int8_linear_f32(const float *x, const int64_t m, const int64_t k, const int64_t x_stride, const int8_t *packed,
                    const float *scale, const float *bias, float *y, const int64_t n, const int num_threads) {
    const int64_t kp = k + (k & 1), panels = (n + PANEL - 1) / PANEL;
    uint16_t *xb = malloc((size_t)(m * kp + 2) * sizeof(uint16_t));
    /* one widened panel per thread, used where a call has several row tiles (prefill) */
    WIDE_TYPE *wide = aligned_alloc(64, (size_t)num_threads * (kp / 2) * sizeof(WIDE_TYPE));
    if (xb == NULL || wide == NULL) {
        free(xb);
        free(wide);
        return -1;
    }
#pragma omp parallel num_threads(num_threads)
    {
        /* the rows rounded to bf16 once (split between the threads: at prefill sizes this is not free) */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) {
            for (int64_t i = 0; i < k; i++) xb[r * kp + i] = to_bf16(x[r * x_stride + i]);
            if (kp != k) xb[r * kp + k] = 0;
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
#ifdef _OPENMP
            const int thread = omp_get_thread_num();
#else
            const int thread = 0;
#endif
            run_panel(xb, m, kp, packed + p * kp * PANEL, wide + thread * (kp / 2), scale, bias, y, n, p * PANEL);
        }
    }
    free(xb);
    free(wide);
    return 0;
}
