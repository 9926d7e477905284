/* Paged prefill (extend) attention for CPU over an fp32 or bf16 KV cache (kv_type.h; queries, the transposed
 * keys and all arithmetic fp32): each chunk's new query tokens attend, causally, over every key
 * of their sequence, the cached prefix and the chunk's own (already stored in the pages), read through the page
 * table where they lie. Flash attention's order: keys in blocks of KB, a running max and sum per query row, so
 * no [queries, keys] score matrix is ever held.
 *
 * Layouts (all contiguous): q and out [T, Hq, D] (the step's rows; a chunk's rows are q_start .. q_start + n);
 * k_cache and v_cache [num_pages, page_size, Hk, D]; block_tables [chunks, bt_stride] int32 page ids; per chunk
 * int32 q_start, n (new tokens) and prefix (tokens cached before them). Query token t of a chunk sits at
 * position prefix + t and sees keys 0 .. prefix + t.
 * Scratch from the caller: key_at (int64, one per key of every chunk), kt (floats, every chunk's keys
 * transposed, each chunk's length rounded up to KB, times Hk * D) and per thread RB * (KB + 2 D) floats.
 *
 * Work: a row is one (query token, query head); the Hq / Hk heads that share a KV head read the same keys, so
 * the rows of one (chunk, KV head) are taken together, RB at a time. Two OpenMP phases on torch's thread team
 * (see paged_decode.c): (1) per chunk, where each key's row lies, and its keys transposed into blocks of
 * [D][KB]; (2) the row blocks. Both matmuls of a block (scores = q K^T, out += p V) are register-tiled
 * broadcast-FMAs with AVX-512 or AVX2; the softmax between them is a plain loop the compiler vectorizes (expf with
 * -ffast-math and libmvec). The head dim is a compile-time constant for the common sizes (64, 128).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "kv_type.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define KB 64 /* keys per block */
#define RB 4  /* rows per block: 4 x 64 outputs (or 2 x 128) are 16 vector registers */

/* s[r][0..KB) = q_r . k_j over one block (kt: [d][KB]), for RB rows of q ([RB][d], zero rows past the last) */
static inline __attribute__((always_inline)) void scores_c(const float *restrict q, const float *restrict kt,
                                                           const int rb, const int64_t d, float *restrict s) {
    memset(s, 0, sizeof(float) * rb * KB);
    for (int64_t i = 0; i < d; i++)
        for (int r = 0; r < rb; r++)
            for (int64_t j = 0; j < KB; j++) s[r * KB + j] += q[r * d + i] * kt[i * KB + j];
}

/* o[r] += sum_j p[r][j] v_j over the block's n keys (v_j at v + at[j]) */
static inline __attribute__((always_inline)) void weighted_values_c(const float *restrict p, const kv_t *restrict v,
                                                                    const int64_t *restrict at, const int64_t n,
                                                                    const int rb, const int64_t d,
                                                                    float *restrict o) {
    for (int64_t j = 0; j < n; j++)
        for (int r = 0; r < rb; r++)
            for (int64_t i = 0; i < d; i++) o[r * d + i] += p[r * KB + j] * kv_float(v[at[j] + i]);
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* scores_c with the rb x 4 accumulators (16 keys a vector) in registers: each step of d is 4 loads of the block
 * and rb x 4 broadcast-FMAs */
static inline __attribute__((always_inline)) void scores_v(const float *restrict q, const float *restrict kt,
                                                           const int rb, const int64_t d, float *restrict s) {
    __m512 acc[RB][4];
    for (int r = 0; r < rb; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i++) {
        const float *krow = kt + i * KB;
        const __m512 k0 = _mm512_loadu_ps(krow), k1 = _mm512_loadu_ps(krow + 16), k2 = _mm512_loadu_ps(krow + 32),
                     k3 = _mm512_loadu_ps(krow + 48);
        for (int r = 0; r < rb; r++) {
            const __m512 b = _mm512_set1_ps(q[r * d + i]);
            acc[r][0] = _mm512_fmadd_ps(b, k0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(b, k1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(b, k2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(b, k3, acc[r][3]);
        }
    }
    for (int r = 0; r < rb; r++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(s + r * KB + 16 * c, acc[r][c]);
}

/* weighted_values_c with the rb x d/16 accumulators in registers (d a multiple of 16, at most 128) */
static inline __attribute__((always_inline)) void weighted_values_v(const float *restrict p, const kv_t *restrict v,
                                                                    const int64_t *restrict at, const int64_t n,
                                                                    const int rb, const int64_t d,
                                                                    float *restrict o) {
    __m512 acc[RB][8];
    for (int r = 0; r < rb; r++)
        for (int64_t c = 0; c < d / 16; c++) acc[r][c] = _mm512_loadu_ps(o + r * d + 16 * c);
    for (int64_t j = 0; j < n; j++) {
        const kv_t *vj = v + at[j];
        __m512 x[8];
        for (int64_t c = 0; c < d / 16; c++) x[c] = KV_LOAD16(vj + 16 * c);
        for (int r = 0; r < rb; r++) {
            const __m512 b = _mm512_set1_ps(p[r * KB + j]);
            for (int64_t c = 0; c < d / 16; c++) acc[r][c] = _mm512_fmadd_ps(b, x[c], acc[r][c]);
        }
    }
    for (int r = 0; r < rb; r++)
        for (int64_t c = 0; c < d / 16; c++) _mm512_storeu_ps(o + r * d + 16 * c, acc[r][c]);
}
#define VECTOR 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* AVX2 (AMD Zen 1-3, Intel before AVX-512) has 16 registers of 8 floats, too few for the AVX-512 tiles: here both
 * matmuls take 2 rows x 32 columns (8 accumulators) at a time, so rb must be even (it is 4, or 2 for d = 128).
 * On a Zen 3 EPYC, 4 x 512 fresh tokens at 2 threads: 16-22 ms a layer, against 38-49 for the portable loops
 * and 23-29 for torch's SDPA path (loadtests/profiles/extend_attention_bench.py). (Decode has no AVX2 path:
 * there the portable loops read each K and V row once, in order, at memory speed; an AVX2 port of the AVX-512
 * tiles, which reads each V row in several passes, measured 1.0-1.6x slower, docs/benchmarks.md.) */
static inline __attribute__((always_inline)) void scores_v(const float *restrict q, const float *restrict kt,
                                                           const int rb, const int64_t d, float *restrict s) {
    for (int r0 = 0; r0 < rb; r0 += 2)
        for (int c0 = 0; c0 < KB; c0 += 32) {
            __m256 acc[2][4];
            for (int r = 0; r < 2; r++)
                for (int c = 0; c < 4; c++) acc[r][c] = _mm256_setzero_ps();
            for (int64_t i = 0; i < d; i++) {
                const float *krow = kt + i * KB + c0;
                const __m256 k0 = _mm256_loadu_ps(krow), k1 = _mm256_loadu_ps(krow + 8),
                             k2 = _mm256_loadu_ps(krow + 16), k3 = _mm256_loadu_ps(krow + 24);
                for (int r = 0; r < 2; r++) {
                    const __m256 b = _mm256_set1_ps(q[(r0 + r) * d + i]);
                    acc[r][0] = _mm256_fmadd_ps(b, k0, acc[r][0]);
                    acc[r][1] = _mm256_fmadd_ps(b, k1, acc[r][1]);
                    acc[r][2] = _mm256_fmadd_ps(b, k2, acc[r][2]);
                    acc[r][3] = _mm256_fmadd_ps(b, k3, acc[r][3]);
                }
            }
            for (int r = 0; r < 2; r++)
                for (int c = 0; c < 4; c++) _mm256_storeu_ps(s + (r0 + r) * KB + c0 + 8 * c, acc[r][c]);
        }
}

static inline __attribute__((always_inline)) void weighted_values_v(const float *restrict p, const kv_t *restrict v,
                                                                    const int64_t *restrict at, const int64_t n,
                                                                    const int rb, const int64_t d,
                                                                    float *restrict o) {
    for (int r0 = 0; r0 < rb; r0 += 2)
        for (int64_t c0 = 0; c0 < d; c0 += 32) {
            __m256 acc[2][4];
            for (int r = 0; r < 2; r++)
                for (int c = 0; c < 4; c++) acc[r][c] = _mm256_loadu_ps(o + (r0 + r) * d + c0 + 8 * c);
            for (int64_t j = 0; j < n; j++) {
                const kv_t *vj = v + at[j] + c0;
                const __m256 x0 = KV_LOAD8(vj), x1 = KV_LOAD8(vj + 8), x2 = KV_LOAD8(vj + 16), x3 = KV_LOAD8(vj + 24);
                for (int r = 0; r < 2; r++) {
                    const __m256 b = _mm256_set1_ps(p[(r0 + r) * KB + j]);
                    acc[r][0] = _mm256_fmadd_ps(b, x0, acc[r][0]);
                    acc[r][1] = _mm256_fmadd_ps(b, x1, acc[r][1]);
                    acc[r][2] = _mm256_fmadd_ps(b, x2, acc[r][2]);
                    acc[r][3] = _mm256_fmadd_ps(b, x3, acc[r][3]);
                }
            }
            for (int r = 0; r < 2; r++)
                for (int c = 0; c < 4; c++) _mm256_storeu_ps(o + (r0 + r) * d + c0 + 8 * c, acc[r][c]);
        }
}
#define VECTOR 1
#else
#define scores_v scores_c
#define weighted_values_v weighted_values_c
#define VECTOR 0
#endif

/* One key block's online softmax for rb rows: s [rb][KB] holds the block's raw scores q . k and becomes its
 * weights (0 for keys past a row's position or the sequence); the rows' running max and sum move on, and their
 * outputs o [rb][d] are rescaled to the new max. */
static inline __attribute__((always_inline)) void softmax_block(float *restrict s, const int64_t *restrict last,
                                                                const int rows, const int rb, const int64_t k0,
                                                                const int64_t n, const int64_t d, const float scale,
                                                                float *restrict mx, float *restrict sum,
                                                                float *restrict o) {
    for (int r = 0; r < rb; r++) {
        float *sr = s + r * KB;
        const int64_t seen = r >= rows ? 0 : (last[r] - k0 + 1 < n ? last[r] - k0 + 1 : n);
        if (seen <= 0) {
            memset(sr, 0, sizeof(float) * KB);
            continue;
        }
        float m = mx[r];
        for (int64_t j = 0; j < seen; j++) m = sr[j] * scale > m ? sr[j] * scale : m;
        const float correction = expf(mx[r] - m);
        float add = 0.0f;
        for (int64_t j = 0; j < KB; j++) {
            sr[j] = j < seen ? expf(sr[j] * scale - m) : 0.0f;
            add += sr[j];
        }
        sum[r] = sum[r] * correction + add;
        mx[r] = m;
        for (int64_t i = 0; i < d; i++) o[r * d + i] *= correction;
    }
}

/* One block of rows: q [rb][d] (rows past `rows` are zeros), row r seeing keys 0 .. last[r]; kt the KV head's
 * transposed keys, v + at[j] its value rows. Writes o [rb][d] = the rows' attention outputs. s: [rb][KB]. */
static inline __attribute__((always_inline)) void attend_rows(
    const float *restrict q, const int64_t *restrict last, const int rows, const int rb, const int vector,
    const float *restrict kt, const kv_t *restrict v, const int64_t *restrict at, const int64_t len,
    const int64_t d, const float scale, float *restrict s, float *restrict o) {
    float mx[RB], sum[RB];
    int64_t reach = 0; /* the last key any row sees */
    for (int r = 0; r < rows; r++) {
        mx[r] = -FLT_MAX;
        sum[r] = 0.0f;
        reach = last[r] > reach ? last[r] : reach;
    }
    memset(o, 0, sizeof(float) * rb * d);
    for (int64_t k0 = 0; k0 <= reach; k0 += KB) {
        const int64_t n = len - k0 < KB ? len - k0 : KB;
        if (vector)
            scores_v(q, kt + (k0 / KB) * d * KB, rb, d, s);
        else
            scores_c(q, kt + (k0 / KB) * d * KB, rb, d, s);
        softmax_block(s, last, rows, rb, k0, n, d, scale, mx, sum, o);
        if (vector)
            weighted_values_v(s, v, at + k0, n, rb, d, o);
        else
            weighted_values_c(s, v, at + k0, n, rb, d, o);
    }
    for (int r = 0; r < rows; r++)
        for (int64_t i = 0; i < d; i++) o[r * d + i] /= sum[r];
}

/* AMX (Intel Xeon from Sapphire Rapids on), bf16 KV cache, head dims 64 and 128: both matmuls of a block on the
 * tile unit. The loops above run the block's 2 x rows x keys x d multiply-adds as fp32 vector FMAs; one tile
 * instruction does 16 x 16 x 32 of them (bf16 operands, fp32 sums), so the softmax between the two matmuls is most
 * of what is left. It is computed transposed, keys down and the 16 rows across: S^T = K Q^T, then each key's scores
 * are one vector (its 16 rows), so the running max, the exponentials and the sums are vertical vector operations
 * with no reduction across lanes, and O^T = V^T P^T. Rows are 16 at a time (a tile's width in fp32), keys 32 (a
 * tile's depth in bf16). The queries and the probabilities are rounded to bf16 for the tiles (a bf16 model's
 * queries are bf16 already; the probabilities' rounding is 2^-9 relative, as in the GPU kernels that keep P in
 * bf16); scores, the running max and sum and the outputs stay fp32. Phase 1 lays out each (chunk, KV head)'s keys
 * as rows ([key][d]) and its values transposed per block ([d][32 keys]), the shapes the tiles load. */
#include "amx.h"
#if defined(KV_BF16) && AMX_BUILT
#define AMX 1
#define AKB 32 /* keys per AMX block */

/* one KV head's keys 0 .. len (zeros past it, to whole blocks): kn [key][d], vt per block [d][AKB] */
static void amx_pack(const kv_t *restrict k_cache, const kv_t *restrict v_cache, const int64_t *restrict at,
                     const int64_t len, const int64_t d, uint16_t *restrict kn, uint16_t *restrict vt) {
    const int64_t padded = (len + AKB - 1) / AKB * AKB;
    for (int64_t j = 0; j < padded; j++) {
        uint16_t *vj = vt + j / AKB * AKB * d + j % AKB;
        if (j < len) {
            memcpy(kn + j * d, k_cache + at[j], d * sizeof(uint16_t));
            for (int64_t i = 0; i < d; i++) vj[i * AKB] = v_cache[at[j] + i];
        } else {
            memset(kn + j * d, 0, d * sizeof(uint16_t));
            for (int64_t i = 0; i < d; i++) vj[i * AKB] = 0;
        }
    }
}

/* e^x for x <= 0 (to 2e-7 relative; below -87 it is 0): x = (n + f) ln 2, 2^f by its Taylor series */
static inline __attribute__((always_inline)) __m512 exp_nonpositive(__m512 x) {
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(1.44269504f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.5403530e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* attend_rows on the tiles, for 16 rows: q [16][d] fp32 (rows past `rows` zeros), o [16][d] out */
static void attend_rows_amx(const float *restrict q, const int64_t *restrict last, const int rows,
                            const uint16_t *restrict kn, const uint16_t *restrict vt, const int64_t len,
                            const int64_t d, const float scale, float *restrict o) {
    uint16_t qt[128 * 16] __attribute__((aligned(64))), pt[AKB * 16] __attribute__((aligned(64)));
    float st[AKB * 16] __attribute__((aligned(64))), pv[128 * 16] __attribute__((aligned(64))),
        ot[128 * 16] __attribute__((aligned(64)));
    int32_t last32[16];
    int64_t reach = 0;
    for (int r = 0; r < 16; r++) {
        last32[r] = r < rows ? (int32_t)last[r] : -1;
        if (r < rows) reach = last[r] > reach ? last[r] : reach;
    }
    /* Q^T as B tiles: per 32 dims, [16 dim pairs][16 rows][2] */
    for (int64_t i = 0; i < d; i++)
        for (int r = 0; r < 16; r++) {
            const float x = q[r * d + i];
            uint32_t u;
            memcpy(&u, &x, 4);
            qt[i / 32 * 512 + (i % 32) / 2 * 32 + r * 2 + i % 2] = (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
        }
    /* interleaves two rows of 16 bf16 (a in 0-15, b in 16-31) as a0 b0 a1 b1 ...: the VNNI pairs of P^T */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i last_v = _mm512_loadu_si512(last32);
    const __m512 scale_v = _mm512_set1_ps(scale);
    __m512 mx = _mm512_set1_ps(-FLT_MAX), sum = _mm512_setzero_ps();
    memset(ot, 0, sizeof(float) * 16 * d);
    for (int64_t k0 = 0; k0 <= reach; k0 += AKB) {
        const uint16_t *kb = kn + k0 * d, *vb = vt + k0 * d;
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t i = 0; i < d; i += 32) {
            _tile_loadd(2, kb + i, d * 2);
            _tile_loadd(3, kb + 16 * d + i, d * 2);
            _tile_loadd(4, qt + i / 32 * 512, 64);
            _tile_dpbf16ps(0, 2, 4);
            _tile_dpbf16ps(1, 3, 4);
        }
        _tile_stored(0, st, 64);
        _tile_stored(1, st + 256, 64);
        /* online softmax down the keys: key j counts for the rows whose position reaches it */
        __mmask16 seen[AKB];
        __m512 m = mx;
        for (int j = 0; j < AKB; j++) {
            seen[j] = k0 + j < len ? _mm512_cmp_epi32_mask(last_v, _mm512_set1_epi32((int32_t)(k0 + j)), _MM_CMPINT_GE)
                                   : 0;
            m = _mm512_mask_max_ps(m, seen[j], m, _mm512_mul_ps(_mm512_load_ps(st + 16 * j), scale_v));
        }
        const __m512 correction = exp_nonpositive(_mm512_sub_ps(mx, m));
        __m512 add = _mm512_setzero_ps();
        for (int j = 0; j < AKB; j += 2) {
            const __m512 a = _mm512_maskz_mov_ps(seen[j], exp_nonpositive(_mm512_fmsub_ps(_mm512_load_ps(st + 16 * j),
                                                                                           scale_v, m)));
            const __m512 b = _mm512_maskz_mov_ps(
                seen[j + 1], exp_nonpositive(_mm512_fmsub_ps(_mm512_load_ps(st + 16 * (j + 1)), scale_v, m)));
            add = _mm512_add_ps(add, _mm512_add_ps(a, b));
            _mm512_store_si512(pt + 16 * j, _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(b, a)));
        }
        sum = _mm512_fmadd_ps(sum, correction, add);
        mx = m;
        /* O^T = V^T P^T, 64 output dims (four tiles of sums) at a time */
        _tile_loadd(2, pt, 64);
        for (int64_t c = 0; c < d; c += 64) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(3);
            _tile_zero(4);
            _tile_loadd(5, vb + c * AKB, AKB * 2);
            _tile_loadd(6, vb + (c + 16) * AKB, AKB * 2);
            _tile_loadd(7, vb + (c + 32) * AKB, AKB * 2);
            _tile_dpbf16ps(0, 5, 2);
            _tile_dpbf16ps(1, 6, 2);
            _tile_dpbf16ps(3, 7, 2);
            _tile_loadd(5, vb + (c + 48) * AKB, AKB * 2);
            _tile_dpbf16ps(4, 5, 2);
            _tile_stored(0, pv + c * 16, 64);
            _tile_stored(1, pv + (c + 16) * 16, 64);
            _tile_stored(3, pv + (c + 32) * 16, 64);
            _tile_stored(4, pv + (c + 48) * 16, 64);
        }
        for (int64_t i = 0; i < d; i++)
            _mm512_store_ps(ot + 16 * i, _mm512_fmadd_ps(_mm512_load_ps(ot + 16 * i), correction, _mm512_load_ps(pv + 16 * i)));
    }
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), sum);
    for (int64_t i = 0; i < d; i++) _mm512_store_ps(ot + 16 * i, _mm512_mul_ps(_mm512_load_ps(ot + 16 * i), inv));
    for (int r = 0; r < rows; r++)
        for (int64_t i = 0; i < d; i++) o[r * d + i] = ot[16 * i + r];
}
#else
#define AMX 0
#endif

/* AVX512-BF16 without AMX (AMD Zen 4 and 5; an AMX Xeon whose OS does not lend the tiles), bf16 KV cache, head dims
 * 64 and 128: both matmuls of a block with `vdpbf16ps`, which does two multiply-adds per fp32 lane, so each is half
 * the instructions of the fp32 FMA tiles above and reads bf16 operands as they are (no widening of every V row).
 * Operands are bf16 pairs along the summed dimension: for the scores, pairs of head dims, which a key's row already
 * is (a uint32 holds two adjacent dims), so phase 1 transposes each block's keys as uint32 [d / 2][KB]; for p V,
 * pairs of keys, so phase 1 interleaves two keys' values per dim, [KB / 2][d] uint32. The queries and the
 * probabilities are rounded to bf16 as on AMX (a bf16 model's queries are bf16 already); scores, softmax and
 * outputs stay fp32. Same tiles as the fp32 path: rb rows x 64 keys, then rb rows x d outputs, in registers. */
#if defined(KV_BF16) && defined(__AVX512BF16__)
#define DPBF16 1

/* r[c] becomes column c of the 16 x 16 uint32 matrix whose rows r held: 32-bit, then 64-bit interleaves within each
 * 128-bit lane leave 4 x 4 blocks transposed, then two rounds of 128-bit lane shuffles put the blocks in place */
static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* u[4i + k], lane L: column 4L + k of rows 4i .. 4i + 3 */
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 2; i++)
        for (int k = 0; k < 4; k++) {
            t[8 * i + k] = _mm512_shuffle_i32x4(u[8 * i + k], u[8 * i + 4 + k], 0x88);     /* lanes 0, 2 of each */
            t[8 * i + 4 + k] = _mm512_shuffle_i32x4(u[8 * i + k], u[8 * i + 4 + k], 0xDD); /* lanes 1, 3 */
        }
    for (int k = 0; k < 8; k++) {
        r[k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0x88);
        r[k + 8] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0xDD);
    }
}

/* one KV head's keys 0 .. len (zeros past it, to whole blocks of KB): kp [block][d / 2][KB] key pairs of dims,
 * vp [key pair][d] pairs of keys' values. The keys go 16 at a time through a register transpose (16 keys x 16 pairs
 * in, 16 pairs x 16 keys out, one vector store each): a small chunk deep in a prompt packs its whole prefix every
 * layer, and one scalar store per pair made that slow (docs/benchmarks.md, the CPU kernels table). */
static void dp_pack(const kv_t *restrict k_cache, const kv_t *restrict v_cache, const int64_t *restrict at,
                    const int64_t len, const int64_t d, uint32_t *restrict kp, uint32_t *restrict vp) {
    const int64_t padded = (len + KB - 1) / KB * KB;
    for (int64_t t0 = 0; t0 < padded; t0 += 16) { /* keys: pairs of dims, transposed into the block */
        uint32_t *kt = kp + t0 / KB * (d / 2) * KB + t0 % KB;
        for (int64_t i0 = 0; i0 < d / 2; i0 += 16) {
            __m512i r[16];
            for (int j = 0; j < 16; j++)
                r[j] = t0 + j < len ? _mm512_loadu_si512(k_cache + at[t0 + j] + 2 * i0) : _mm512_setzero_si512();
            transpose16(r);
            for (int c = 0; c < 16; c++) _mm512_storeu_si512(kt + (i0 + c) * KB, r[c]);
        }
    }
    /* a0 b0 a1 b1 ... a15 b15 of two vectors of 32 bf16 (b's indices from 32), and the same of their upper halves */
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5,
                                        36, 4, 35, 3, 34, 2, 33, 1, 32, 0),
                  hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t j = 0; j < padded; j += 2)
        for (int64_t i = 0; i < d; i += 32) { /* values: two keys' interleaved, 32 dims at a time */
            const __m512i a = j < len ? _mm512_loadu_si512(v_cache + at[j] + i) : _mm512_setzero_si512(),
                          b = j + 1 < len ? _mm512_loadu_si512(v_cache + at[j + 1] + i) : _mm512_setzero_si512();
            _mm512_storeu_si512(vp + j / 2 * d + i, _mm512_permutex2var_epi16(a, lo, b));
            _mm512_storeu_si512(vp + j / 2 * d + i + 16, _mm512_permutex2var_epi16(a, hi, b));
        }
}

/* attend_rows with bf16 dot products, for rb rows (4 of d = 64, 2 of d = 128): q [rb][d] fp32 (rows past `rows`
 * zeros); writes o [rb][d]. s: [rb][KB] */
static inline __attribute__((always_inline)) void attend_rows_dp(
    const float *restrict q, const int64_t *restrict last, const int rows, const int rb,
    const uint32_t *restrict kp, const uint32_t *restrict vp, const int64_t len, const int64_t d,
    const float scale, float *restrict s, float *restrict o) {
    uint32_t qp[RB * 64] __attribute__((aligned(64))), pp[RB * KB / 2] __attribute__((aligned(64)));
    float mx[RB], sum[RB];
    int64_t reach = 0;
    for (int r = 0; r < rows; r++) {
        mx[r] = -FLT_MAX;
        sum[r] = 0.0f;
        reach = last[r] > reach ? last[r] : reach;
    }
    for (int r = 0; r < rb; r++) /* the queries as bf16 pairs of dims */
        for (int64_t i = 0; i < d; i += 32)
            _mm512_store_si512(qp + (r * d + i) / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + r * d + i + 16),
                                                                                 _mm512_loadu_ps(q + r * d + i)));
    memset(o, 0, sizeof(float) * rb * d);
    for (int64_t k0 = 0; k0 <= reach; k0 += KB) {
        const int64_t n = len - k0 < KB ? len - k0 : KB;
        const uint32_t *kb = kp + k0 / KB * (d / 2) * KB;
        __m512 acc[RB][8];
        for (int r = 0; r < rb; r++)
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
        for (int64_t i = 0; i < d / 2; i++) {
            const __m512i k0v = _mm512_loadu_si512(kb + i * KB), k1v = _mm512_loadu_si512(kb + i * KB + 16),
                          k2v = _mm512_loadu_si512(kb + i * KB + 32), k3v = _mm512_loadu_si512(kb + i * KB + 48);
            for (int r = 0; r < rb; r++) {
                const __m512bh b = (__m512bh)_mm512_set1_epi32((int)qp[r * d / 2 + i]);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)k0v, b);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)k1v, b);
                acc[r][2] = _mm512_dpbf16_ps(acc[r][2], (__m512bh)k2v, b);
                acc[r][3] = _mm512_dpbf16_ps(acc[r][3], (__m512bh)k3v, b);
            }
        }
        for (int r = 0; r < rb; r++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(s + r * KB + 16 * c, acc[r][c]);
        softmax_block(s, last, rows, rb, k0, n, d, scale, mx, sum, o);
        for (int r = 0; r < rb; r++) /* the weights as bf16 pairs of keys */
            for (int j = 0; j < KB; j += 32)
                _mm512_store_si512(pp + (r * KB + j) / 2, (__m512i)_mm512_cvtne2ps_pbh(
                                                              _mm512_loadu_ps(s + r * KB + j + 16), _mm512_loadu_ps(s + r * KB + j)));
        const uint32_t *vb = vp + k0 / 2 * d;
        for (int r = 0; r < rb; r++)
            for (int64_t c = 0; c < d / 16; c++) acc[r][c] = _mm512_loadu_ps(o + r * d + 16 * c);
        for (int64_t j = 0; j < (n + 1) / 2; j++) { /* an odd block's last pair: its second key is zeros, weight 0 */
            __m512i x[8];
            for (int64_t c = 0; c < d / 16; c++) x[c] = _mm512_loadu_si512(vb + j * d + 16 * c);
            for (int r = 0; r < rb; r++) {
                const __m512bh b = (__m512bh)_mm512_set1_epi32((int)pp[r * KB / 2 + j]);
                for (int64_t c = 0; c < d / 16; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)x[c], b);
            }
        }
        for (int r = 0; r < rb; r++)
            for (int64_t c = 0; c < d / 16; c++) _mm512_storeu_ps(o + r * d + 16 * c, acc[r][c]);
    }
    for (int r = 0; r < rows; r++)
        for (int64_t i = 0; i < d; i++) o[r * d + i] /= sum[r];
}
#else
#define DPBF16 0
#endif

#ifndef KV_BF16 /* once in the library */
/* the vector width (floats) of this build's tiles: 16 (AVX-512), 8 (AVX2) or 1 (portable C) */
int paged_vector_floats(void) {
#if defined(__AVX512F__)
    return 16;
#elif defined(__AVX2__) && defined(__FMA__)
    return 8;
#else
    return 1;
#endif
}
#endif

/* How this build's bf16 extend kernel runs its blocks here: 2 on AMX tiles (the CPU has them and the OS lends them),
 * 1 with AVX512-BF16 dot products, 0 with fp32 arithmetic (the FMA tiles or the portable loops) */
#ifdef KV_BF16
int paged_extend_bf16_path(void) {
#if AMX
    if (amx_permitted()) return 2;
#endif
    return DPBF16;
}
#endif

void KV_NAME(paged_extend)(const float *q, const kv_t *k_cache, const kv_t *v_cache, const int32_t *block_tables,
                      int64_t bt_stride, const int32_t *q_start, const int32_t *new_lens,
                      const int32_t *prefix_lens, int64_t num_chunks, float *out, int64_t num_q_heads,
                      int64_t num_kv_heads, int64_t head_dim, int64_t page_size, float scale, int64_t *key_at,
                      float *kt_scratch, float *row_scratch, int64_t row_scratch_stride, int64_t num_threads) {
    const int64_t group = num_q_heads / num_kv_heads, token_stride = num_kv_heads * head_dim, d = head_dim;
#if AMX
    const int amx = (d == 64 || d == 128) && amx_permitted();
#else
    const int amx = 0;
#endif
    const int dp = !amx && DPBF16 && (d == 64 || d == 128);
    const int rb = amx ? 16 : (VECTOR || dp) && d == 128 ? 2 : RB; /* rows an item takes */
    /* per chunk: where its key offsets and transposed keys start, and its first row block in the item list */
    int64_t at0[num_chunks + 1], kt0[num_chunks + 1], item0[num_chunks + 1];
    at0[0] = kt0[0] = item0[0] = 0;
    for (int64_t c = 0; c < num_chunks; c++) {
        const int64_t len = prefix_lens[c] + new_lens[c], blocks = (len + KB - 1) / KB;
        at0[c + 1] = at0[c] + len;
        kt0[c + 1] = kt0[c] + blocks * num_kv_heads * d * KB;
        item0[c + 1] = item0[c] + num_kv_heads * ((new_lens[c] * group + rb - 1) / rb);
    }
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < num_chunks; c++) {
            const int32_t *pages = block_tables + c * bt_stride;
            int64_t *at = key_at + at0[c];
            for (int64_t j = 0; j < prefix_lens[c] + new_lens[c]; j++)
                at[j] = ((int64_t)pages[j / page_size] * page_size + j % page_size) * token_stride;
        }
        /* the packing, a (chunk, KV head) at a time: one chunk deep in a prompt (a decoding step's prefill) still
         * packs on every thread */
#pragma omp for schedule(dynamic, 1)
        for (int64_t cg = 0; cg < num_chunks * num_kv_heads; cg++) {
            const int64_t c = cg / num_kv_heads, g = cg % num_kv_heads;
            const int64_t len = prefix_lens[c] + new_lens[c], blocks = (len + KB - 1) / KB;
            const int64_t *at = key_at + at0[c];
            float *kt = kt_scratch + kt0[c] + g * blocks * d * KB;
#if AMX
            if (amx) { /* the tiles' layouts of K and V (as many bytes as the fp32 keys of the other paths) */
                uint16_t *kn = (uint16_t *)kt;
                amx_pack(k_cache + g * d, v_cache + g * d, at, len, d, kn, kn + (len + AKB - 1) / AKB * AKB * d);
                continue;
            }
#endif
#if DPBF16
            if (dp) { /* the dot products' layouts of K and V (as many bytes as the fp32 keys of the other paths) */
                uint32_t *kp = (uint32_t *)kt;
                dp_pack(k_cache + g * d, v_cache + g * d, at, len, d, kp, kp + blocks * (d / 2) * KB);
                continue;
            }
#endif
            for (int64_t j = 0; j < blocks * KB; j++)
                for (int64_t i = 0; i < d; i++)
                    kt[(j / KB) * d * KB + i * KB + j % KB] = j < len ? kv_float(k_cache[at[j] + g * d + i]) : 0.0f;
        }
#ifdef _OPENMP
        float *scratch = row_scratch + omp_get_thread_num() * row_scratch_stride;
#else
        float *scratch = row_scratch;
#endif
        float *qb = scratch, *s = qb + rb * d, *o = s + rb * KB; /* [rb][d], [rb][KB], [rb][d] */
#if AMX
        if (amx) amx_configure(16);
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < item0[num_chunks]; item++) {
            int64_t c = 0;
            while (item0[c + 1] <= item) c++;
            const int64_t per_head = (item0[c + 1] - item0[c]) / num_kv_heads;
            const int64_t g = (item - item0[c]) / per_head, first = ((item - item0[c]) % per_head) * rb;
            const int64_t len = prefix_lens[c] + new_lens[c], blocks = (len + KB - 1) / KB;
            int64_t last[16], row_of[16];
            int rows = 0;
            memset(qb, 0, sizeof(float) * rb * d);
            for (int64_t m = first; m < first + rb && m < new_lens[c] * group; m++, rows++) {
                const int64_t t = m / group, row = (q_start[c] + t) * num_q_heads + g * group + m % group;
                memcpy(qb + rows * d, q + row * d, sizeof(float) * d);
                row_of[rows] = row;
                last[rows] = prefix_lens[c] + t;
            }
            const float *kt = kt_scratch + kt0[c] + g * blocks * d * KB;
            const kv_t *vg = v_cache + g * d;
            const int64_t *at = key_at + at0[c];
#if AMX
            if (amx) {
                const uint16_t *kn = (const uint16_t *)kt;
                attend_rows_amx(qb, last, rows, kn, kn + (len + AKB - 1) / AKB * AKB * d, len, d, scale, o);
            } else
#endif
#if DPBF16
            if (dp) { /* dp_pack's layout: the key pairs, then the value pairs; constant head dims unroll the tiles */
                const uint32_t *kp = (const uint32_t *)kt, *vp = kp + blocks * (d / 2) * KB;
                if (d == 64)
                    attend_rows_dp(qb, last, rows, 4, kp, vp, len, 64, scale, s, o);
                else
                    attend_rows_dp(qb, last, rows, 2, kp, vp, len, 128, scale, s, o);
            } else
#endif
            if (VECTOR && d == 64) /* constant sizes: the tiles unroll and stay in registers */
                attend_rows(qb, last, rows, 4, 1, kt, vg, at, len, 64, scale, s, o);
            else if (VECTOR && d == 128)
                attend_rows(qb, last, rows, 2, 1, kt, vg, at, len, 128, scale, s, o);
            else
                attend_rows(qb, last, rows, RB, 0, kt, vg, at, len, d, scale, s, o);
            for (int r = 0; r < rows; r++) memcpy(out + row_of[r] * d, o + r * d, sizeof(float) * d);
        }
#if AMX
        if (amx) _tile_release();
#endif
    }
}
