/* int8 weights with one scale per group of input columns, fp32 math: y[M, N] = x[M, K] . (q * s)[N, K]^T + bias[N].
 *
 * Why: a GGUF Q8_0 file stores every matrix as blocks of 32 int8 weights sharing one scale (llama.cpp's format).
 * Serving those blocks as they are keeps a quarter of fp32's weight bytes without re-quantizing them per output
 * channel (which would round each weight a second time). The weights are dequantized in registers only: each
 * int8 vector is widened to fp32 and multiplied by its group's scales, then multiplied into the rows with fp32
 * FMAs. q * s is exact in fp32 (8 bits times a fp16 scale's 11), so the result is the fp32 product with the
 * dequantized matrix, up to the order of the sums. With one group per row (per-channel int8) the scale multiplies
 * the sums once instead of every weight. Only AVX2 and FMA are needed, so every x86-64 CPU of the last decade
 * takes the vector loop.
 *
 * Layouts: x [M, K] fp32, row-major (row stride x_stride floats); the weights packed at load (cpu_int8_grouped.py)
 * as [Np / 8][K][8] int8: panel p, input column j, output column c holds q[8p + c][j], N padded to Np (a multiple
 * of 8) by zero weights; the scales as [Np / 8][K / G][8] fp32 (group g of panel p, column c: s[8p + c][g]);
 * bias [N] or NULL; y [M, N]. K is a multiple of the group size G.
 *
 * Work: threads split the 8-column panels; a tile of up to 10 rows keeps its 10 x 8 sums in registers over the
 * whole K (with the weights, the scales and a broadcast row value, 13 of AVX2's 16 vector registers: at 12 rows
 * GCC spilled two of them inside the K loop); rows go in blocks that stay in cache while a thread runs its panels
 * over them. Nothing is allocated. At decode sizes this is faster than fp32 GEMM (a quarter of the bytes); at
 * prefill sizes the tiles fall behind MKL's fp32 GEMM (a 4 x 512-token prefill step 1.5x slower on a Zen 3), so
 * cpu_int8_grouped.py gives a call of more than 64 rows to MKL on its matrix dequantized for that call
 * (`int8_grouped_dequantize_f32`, at the end).
 */
#include <stdint.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VECTOR_PATH 1
#else
#define VECTOR_PATH 0
#endif

#define PANEL 8
#define ROW_TILE 10
#define ROW_BLOCK 100 /* rows a thread reuses across its panels: 100 x K floats stay in L2 at K <= 1536 */

int int8_grouped_vector_path(void) { return VECTOR_PATH; }

#if VECTOR_PATH
/* `rows` and `one_group` are compile-time constants at every call (the switch below), so the sums stay in
 * registers. set1 of a loaded float, not _mm256_broadcast_ss(pointer): through the pointer GCC kept the sums in
 * memory, a store after every multiply-add. */
static inline __attribute__((always_inline)) void tile(const int rows, const int one_group, const float *x,
                                                       const int64_t x_stride, const int64_t k,
                                                       const int64_t g, const int8_t *panel, const float *scales,
                                                       const float *bias, float *y, const int64_t n,
                                                       const int64_t n0) {
    __m256 acc[ROW_TILE];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    if (one_group) { /* one scale per output column: it multiplies the sums once, after K */
        for (int64_t j = 0; j < k; j++) {
            const __m128i q8 = _mm_loadl_epi64((const __m128i *)(panel + j * PANEL));
            const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8));
            for (int r = 0; r < rows; r++) acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * x_stride + j]), w, acc[r]);
        }
        const __m256 s = _mm256_loadu_ps(scales);
        for (int r = 0; r < rows; r++) acc[r] = _mm256_mul_ps(acc[r], s);
    } else { /* the weights scaled in registers, group by group */
        for (int64_t k0 = 0; k0 < k; k0 += g) {
            const __m256 s = _mm256_loadu_ps(scales + (k0 / g) * PANEL);
            for (int64_t j = k0; j < k0 + g; j++) {
                const __m128i q8 = _mm_loadl_epi64((const __m128i *)(panel + j * PANEL));
                const __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), s);
                for (int r = 0; r < rows; r++)
                    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * x_stride + j]), w, acc[r]);
            }
        }
    }
    /* masked loads and stores for a last panel narrower than 8 */
    const int64_t width = n - n0 < PANEL ? n - n0 : PANEL;
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)width), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 b = bias ? _mm256_maskload_ps(bias + n0, mask) : _mm256_setzero_ps();
    for (int r = 0; r < rows; r++) _mm256_maskstore_ps(y + r * n + n0, mask, _mm256_add_ps(acc[r], b));
}

#define TILE_CASE(R)                                                                  \
    case R:                                                                           \
        if (g == k) tile(R, 1, x, x_stride, k, g, panel, scales, bias, y, n, n0);       \
        else tile(R, 0, x, x_stride, k, g, panel, scales, bias, y, n, n0);              \
        break;

static void run_tile(const int rows, const float *x, const int64_t x_stride, const int64_t k,
                     const int64_t g, const int8_t *panel, const float *scales, const float *bias, float *y,
                     const int64_t n, const int64_t n0) {
    switch (rows) {
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5)
        TILE_CASE(6) TILE_CASE(7) TILE_CASE(8) TILE_CASE(9) TILE_CASE(10)
    }
}
#else
/* portable: the same products, one output at a time */
static void run_tile(const int rows, const float *x, const int64_t x_stride, const int64_t k,
                     const int64_t g, const int8_t *panel, const float *scales, const float *bias, float *y,
                     const int64_t n, const int64_t n0) {
    const int64_t width = n - n0 < PANEL ? n - n0 : PANEL;
    for (int r = 0; r < rows; r++)
        for (int64_t c = 0; c < width; c++) {
            float sum = 0.0f;
            for (int64_t j = 0; j < k; j++)
                sum += x[r * x_stride + j] * ((float)panel[j * PANEL + c] * scales[(j / g) * PANEL + c]);
            y[r * n + n0 + c] = sum + (bias ? bias[n0 + c] : 0.0f);
        }
}
#endif

/* rows [m0, m0 + rows) of one panel, in tiles of even size (16 rows: two tiles of 8, not 10 + 6) */
static void run_rows(const float *x, const int64_t m0, const int64_t rows, const int64_t x_stride, const int64_t k,
                     const int64_t g, const int8_t *panel, const float *scales, const float *bias, float *y,
                     const int64_t n, const int64_t n0) {
    const int64_t tiles = (rows + ROW_TILE - 1) / ROW_TILE;
    for (int64_t t = 0, r0 = 0; t < tiles; t++) {
        const int64_t size = (rows - r0) / (tiles - t); /* the rows left, shared evenly by the tiles left */
        const int64_t r = m0 + r0;
        run_tile((int)size, x + r * x_stride, x_stride, k, g, panel, scales, bias, y + r * n, n, n0);
        r0 += size;
    }
}

void int8_grouped_f32(const float *x, const int64_t m, const int64_t k, const int64_t x_stride, const int8_t *packed,
                      const float *scales, const int64_t g, const float *bias, float *y, const int64_t n,
                      const int num_threads) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel num_threads(num_threads)
    for (int64_t m0 = 0; m0 < m; m0 += ROW_BLOCK) {
        const int64_t rows = m - m0 < ROW_BLOCK ? m - m0 : ROW_BLOCK;
        /* static: each thread gets the same panels in every block, and writes only their columns (no barrier) */
#pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < panels; p++)
            run_rows(x, m0, rows, x_stride, k, g, packed + p * k * PANEL, scales + p * (k / g) * PANEL, bias, y, n,
                     p * PANEL);
    }
}

/* w[N, K] = q * s, row-major: the matrix of one prefill-sized call, for MKL's GEMM (q * s is exact in fp32) */
void int8_grouped_dequantize_f32(const int8_t *packed, const float *scales, const int64_t k, const int64_t g,
                                 const int64_t n, float *w, const int num_threads) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; p++) {
        const int8_t *panel = packed + p * k * PANEL;
        const float *s = scales + p * (k / g) * PANEL;
        const int64_t width = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;
        for (int64_t c = 0; c < width; c++) {
            float *row = w + (p * PANEL + c) * k;
            for (int64_t j = 0; j < k; j++) row[j] = (float)panel[j * PANEL + c] * s[(j / g) * PANEL + c];
        }
    }
}
