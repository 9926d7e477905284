/* bf16 linear layer for CPU: y[M, N] = x[M, K] . w[N, K]^T + bias[N], bf16 in and out, fp32 sums.
 *
 * Why: a bf16 model's matmuls ran on oneDNN's bf16 inner product (cpu_linear.py). On a CPU with AVX512_BF16 but
 * no AMX (AMD Zen 4 and 5) oneDNN's decode-sized calls measured far below what the machine does: one row of
 * SmolLM2's gate_up at 5.6 GB/s of weights, 16 rows at about 130 GFLOP/s (loadtests/profiles/matmul_bench.py).
 * A decode step is those calls, 121 of them. This kernel is the int8 kernel's loop (int8_linear.c) with the
 * weights already bf16: one `vdpbf16ps` does two multiply-adds per fp32 lane from a weight vector loaded as it
 * lies in memory, so a one-row call streams the weights at memory speed and a 16-row call keeps 16 x 16 sums in
 * registers over the whole K.
 *
 * Layouts: x [M, K] bf16, row-major (row stride x_stride elements); the weight packed at load (cpu_linear.py) as
 * [Np / 16][Kp / 2][16][2] bf16: panel p, K pair j, output column c, element e holds w[16p + c][2j + e], with N
 * padded to Np (a multiple of 16) and K to Kp (even) by zeros; bias [N] bf16 or NULL; y [M, N] row-major, bf16,
 * or fp32 with y_f32 (the LM head: logits keep the fp32 sums, as bf16 logits near 25 are 0.125 apart and greedy
 * choices tie).
 * Where K is odd or the rows are strided, the call copies the rows into an even-width scratch first.
 *
 * Work: threads split the 16-column panels; a panel runs every tile of up to 16 rows, its weights read from
 * memory by the first tile and from cache by the next ones. A tile of 1 to 3 rows (few sequences decoding)
 * splits K between two sets of sums so that the multiply-adds are not one dependent chain.
 *
 * Without AVX512_BF16 the portable loop below computes the same sums one by one (the tests hold both to one
 * reference); cpu_linear.py then keeps oneDNN, which is faster than the portable loop.
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
#define ROW_TILE 8 /* rows x PANELS sums, 24 of the 32 vector registers */
#define PANELS 3

static inline float from_bf16(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* fp32 -> bf16, round to nearest even (finite inputs), as vcvtneps2bf16 does */
static inline uint16_t to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    bits += 0x7fff + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

int bf16_linear_vector_path(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

#ifdef __AVX512BF16__
/* rows [0, rows) of xb x panels [0, panels) from `panel`: rows x panels sums of 16 columns each, in registers
 * over the whole K (`rows` and `panels` are compile-time constants at every call, the switch below). Each
 * weight vector loaded serves `rows` products and each broadcast row pair `panels`: at 8 x 3 the loop issues
 * 11 loads for 24 `vdpbf16ps`, where one panel at a time (as int8_linear.c) issued one load per product. */
static inline __attribute__((always_inline)) void tile(const int rows, const int panels, const uint16_t *xb,
                                                       const int64_t xs, const int64_t kp, const uint16_t *panel,
                                                       const uint16_t *bias, void *y, const int y_f32,
                                                       const int64_t n, const int64_t n0) {
    __m512 acc[ROW_TILE][PANELS];
    for (int r = 0; r < rows; r++)
        for (int q = 0; q < panels; q++) acc[r][q] = _mm512_setzero_ps();
    const __m512i *w = (const __m512i *)panel;
    const int64_t panel_vectors = kp / 2; /* one vector per K pair in each panel */
    for (int64_t j = 0; j < kp / 2; j++) {
        __m512bh wj[PANELS];
        for (int q = 0; q < panels; q++) wj[q] = (__m512bh)_mm512_loadu_si512(w + q * panel_vectors + j);
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            memcpy(&pair, xb + r * xs + 2 * j, 4);
            const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);
            for (int q = 0; q < panels; q++) acc[r][q] = _mm512_dpbf16_ps(acc[r][q], xr, wj[q]);
        }
    }
    for (int q = 0; q < panels; q++) {
        const int64_t c0 = n0 + q * PANEL, width = n - c0 < PANEL ? n - c0 : PANEL;
        const __mmask16 mask = (__mmask16)((1u << width) - 1);
        const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + c0)), 16))
                              : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const __m512 out = _mm512_add_ps(acc[r][q], b);
            if (y_f32)
                _mm512_mask_storeu_ps((float *)y + r * n + c0, mask, out);
            else
                _mm256_mask_storeu_epi16((uint16_t *)y + r * n + c0, mask, (__m256i)_mm512_cvtneps_pbh(out));
        }
    }
}

#define TILE_CASE(R)                                                                  \
    case R:                                                                           \
        if (panels == 3) tile(R, 3, xb, xs, kp, panel, bias, y, y_f32, n, n0);        \
        else if (panels == 2) tile(R, 2, xb, xs, kp, panel, bias, y, y_f32, n, n0);   \
        else tile(R, 1, xb, xs, kp, panel, bias, y, y_f32, n, n0);                    \
        break;

static void run_tile(const int rows, const int panels, const uint16_t *xb, const int64_t xs, const int64_t kp,
                     const uint16_t *panel, const uint16_t *bias, void *y, const int y_f32, const int64_t n,
                     const int64_t n0) {
    switch (rows) { TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6) TILE_CASE(7) TILE_CASE(8) }
}
#else
/* portable: the same sums in the same precision (bf16 products summed in fp32), one output at a time */
static void run_tile(const int rows, const int panels, const uint16_t *xb, const int64_t xs, const int64_t kp,
                     const uint16_t *panel, const uint16_t *bias, void *y, const int y_f32, const int64_t n,
                     const int64_t n0) {
    const int64_t width = n - n0 < panels * PANEL ? n - n0 : panels * PANEL;
    for (int r = 0; r < rows; r++)
        for (int64_t c = 0; c < width; c++) {
            float sum = 0.0f;
            for (int64_t j = 0; j < kp / 2; j++) {
                const uint16_t *w = panel + (c / PANEL) * kp * PANEL + j * 2 * PANEL + 2 * (c % PANEL);
                sum += from_bf16(xb[r * xs + 2 * j]) * from_bf16(w[0]) +
                       from_bf16(xb[r * xs + 2 * j + 1]) * from_bf16(w[1]);
            }
            const float out = sum + (bias ? from_bf16(bias[n0 + c]) : 0.0f);
            if (y_f32)
                ((float *)y)[r * n + n0 + c] = out;
            else
                ((uint16_t *)y)[r * n + n0 + c] = to_bf16(out);
        }
}
#endif

#include "amx.h"
#if AMX_BUILT
/* On AMX the same product on the tile unit: for the LM head (oneDNN's AMX path rounds its outputs to bf16, and
 * logits must keep their fp32 sums) and the layers' decode-sized calls (cpu_linear.py). The packed panels are already
 * what a tile reads as its right operand: 16 consecutive K pairs of a panel are one [16 pairs][16 columns][2] tile.
 * Up to 16 rows (a tile's height) x 4 panels (64 columns, four tiles of sums) at a time, K in steps of 32; from 17
 * rows on, 2 panels at a time, over blocks of 32 rows (amx_block_2x2) and then the rows left. On an AMX Xeon this
 * ran 1.1-1.6x oneDNN's speed up to 64 rows and 0.88-1.43x by layer at 272 (matmul_bench), so the layers take it
 * for decode steps and oneDNN beyond (cpu_linear.py). */
static inline int width_full(const int panels, const int64_t n, const int64_t n0) {
    return n - n0 >= panels * PANEL;
}

/* one panel's 16 x 16 sums (`sums`, rows of 16 floats) plus the bias into y's rows, bf16 or fp32 */
static void amx_finish(const float *sums, const int rows, const uint16_t *bias, void *y, const int y_f32,
                       const int64_t n, const int64_t c0) {
    const int64_t left = n - c0;
    const __mmask16 keep = left >= PANEL ? 0xFFFF : (__mmask16)((1u << left) - 1);
    const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, bias + c0)), 16))
                          : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        const __m512 out = _mm512_add_ps(_mm512_load_ps(sums + r * 16), b);
        if (y_f32)
            _mm512_mask_storeu_ps((float *)y + r * n + c0, keep, out);
        else
            _mm256_mask_storeu_epi16((uint16_t *)y + r * n + c0, keep, (__m256i)_mm512_cvtneps_pbh(out));
    }
}

/* tiles 0-3: the sums */
static inline void zero_sums(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

static void amx_block(const int rows, const int panels, const uint16_t *xb, const int64_t xs, const int64_t kp,
                      const uint16_t *panel, const uint16_t *bias, void *y, const int y_f32, const int64_t n,
                      const int64_t n0) {
    float sums[4][16 * 16] __attribute__((aligned(64)));
    zero_sums();
    for (int64_t k0 = 0; k0 < kp; k0 += 32) {
        const uint16_t *b = panel + k0 * PANEL;
        _tile_loadd(4, xb + k0, xs * 2);
        _tile_loadd(5, b, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (panels > 1) {
            _tile_loadd(6, b + kp * PANEL, 64);
            _tile_dpbf16ps(1, 4, 6);
        }
        if (panels > 2) {
            _tile_loadd(7, b + 2 * kp * PANEL, 64);
            _tile_dpbf16ps(2, 4, 7);
        }
        if (panels > 3) {
            _tile_loadd(5, b + 3 * kp * PANEL, 64);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    if (y_f32 && !bias && width_full(panels, n, n0)) { /* the sums are the outputs: straight into y's rows */
        float *out = (float *)y + n0;
        _tile_stored(0, out, n * 4);
        if (panels > 1) _tile_stored(1, out + 16, n * 4);
        if (panels > 2) _tile_stored(2, out + 32, n * 4);
        if (panels > 3) _tile_stored(3, out + 48, n * 4);
        return;
    }
    _tile_stored(0, sums[0], 64);
    if (panels > 1) _tile_stored(1, sums[1], 64);
    if (panels > 2) _tile_stored(2, sums[2], 64);
    if (panels > 3) _tile_stored(3, sums[3], 64);
    for (int q = 0; q < panels; q++) amx_finish(sums[q], rows, bias, y, y_f32, n, n0 + q * PANEL);
}

/* 32 rows x 2 panels, the tiles configured 16 rows high: each operand tile loaded serves two products, where
 * amx_block's 16 x 4 loads five tiles for four products */
static void amx_block_2x2(const uint16_t *xb, const int64_t xs, const int64_t kp, const uint16_t *panel,
                          const uint16_t *bias, void *y, const int y_f32, const int64_t n, const int64_t n0) {
    float sums[16 * 16] __attribute__((aligned(64)));
    zero_sums();
    for (int64_t k0 = 0; k0 < kp; k0 += 32) {
        const uint16_t *b = panel + k0 * PANEL;
        _tile_loadd(4, xb + k0, xs * 2);
        _tile_loadd(5, xb + 16 * xs + k0, xs * 2);
        _tile_loadd(6, b, 64);
        _tile_loadd(7, b + kp * PANEL, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    char *lower = (char *)y + 16 * n * (y_f32 ? 4 : 2); /* rows 16-31 */
    _tile_stored(0, sums, 64);
    amx_finish(sums, 16, bias, y, y_f32, n, n0);
    _tile_stored(1, sums, 64);
    amx_finish(sums, 16, bias, y, y_f32, n, n0 + PANEL);
    _tile_stored(2, sums, 64);
    amx_finish(sums, 16, bias, lower, y_f32, n, n0);
    _tile_stored(3, sums, 64);
    amx_finish(sums, 16, bias, lower, y_f32, n, n0 + PANEL);
}

static void amx_linear(const uint16_t *xb, const int64_t m, const int64_t xs, const int64_t kp,
                       const uint16_t *packed, const uint16_t *bias, void *y, const int y_f32, const int64_t n,
                       const int num_threads) {
    /* a thread's unit of work: 4 panels over every row up to 16 rows, 2 panels over blocks of 32 rows beyond */
    const int per = m > 16 ? 2 : 4;
    const int64_t panels = (n + PANEL - 1) / PANEL, groups = (panels + per - 1) / per;
#pragma omp parallel num_threads(num_threads)
    {
        int configured = 0;
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int width = (int)(panels - per * g < per ? panels - per * g : per);
            const uint16_t *w = packed + per * g * kp * PANEL;
            const int64_t n0 = per * g * PANEL;
            int64_t m0 = 0;
            for (; width == 2 && m0 + 32 <= m; m0 += 32) {
                if (configured != 16) {
                    amx_configure(16);
                    configured = 16;
                }
                void *y_rows = y_f32 ? (void *)((float *)y + m0 * n) : (void *)((uint16_t *)y + m0 * n);
                amx_block_2x2(xb + m0 * xs, xs, kp, w, bias, y_rows, y_f32, n, n0);
            }
            for (; m0 < m; m0 += 16) {
                const int rows = (int)(m - m0 < 16 ? m - m0 : 16);
                if (rows != configured) { /* the tiles' height: the rows left, so no row past the last is read */
                    amx_configure(rows);
                    configured = rows;
                }
                void *y_rows = y_f32 ? (void *)((float *)y + m0 * n) : (void *)((uint16_t *)y + m0 * n);
                amx_block(rows, width, xb + m0 * xs, xs, kp, w, bias, y_rows, y_f32, n, n0);
            }
        }
        if (configured) _tile_release();
    }
}
#endif

/* 1 where bf16_linear runs on AMX tiles (for widths that are a multiple of 32) */
int bf16_linear_amx(void) {
#if AMX_BUILT
    return amx_permitted();
#else
    return 0;
#endif
}

/* Returns 0, or -1 when the scratch for odd-width or strided rows could not be allocated (nothing written). */
int bf16_linear(const uint16_t *x, const int64_t m, const int64_t k, const int64_t x_stride,
                const uint16_t *packed, const uint16_t *bias, void *y, const int y_f32, const int64_t n,
                const int num_threads) {
    const int64_t kp = k + (k & 1), panels = (n + PANEL - 1) / PANEL;
    const uint16_t *xb = x;
    int64_t xs = x_stride;
    uint16_t *copy = NULL;
    if (k != kp) { /* an even width, the odd column's partner zero: the loops read K in pairs */
        copy = malloc((size_t)(m * kp) * sizeof(uint16_t));
        if (copy == NULL) return -1;
        for (int64_t r = 0; r < m; r++) {
            memcpy(copy + r * kp, x + r * x_stride, (size_t)k * sizeof(uint16_t));
            copy[r * kp + k] = 0;
        }
        xb = copy;
        xs = kp;
    }
#if AMX_BUILT
    if (kp % 32 == 0 && amx_permitted()) {
        amx_linear(xb, m, xs, kp, packed, bias, y, y_f32, n, num_threads);
        free(copy);
        return 0;
    }
#endif
    const int64_t groups = (panels + PANELS - 1) / PANELS;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t p = g * PANELS;
        const int width = (int)(panels - p < PANELS ? panels - p : PANELS);
        for (int64_t m0 = 0; m0 < m; m0 += ROW_TILE) {
            const int rows = (int)(m - m0 < ROW_TILE ? m - m0 : ROW_TILE);
            void *y_rows = y_f32 ? (void *)((float *)y + m0 * n) : (void *)((uint16_t *)y + m0 * n);
            run_tile(rows, width, xb + m0 * xs, xs, kp, packed + p * kp * PANEL, bias, y_rows, y_f32, n, p * PANEL);
        }
    }
    free(copy);
    return 0;
}
