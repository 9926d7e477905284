/* The element type of the KV cache the attention kernels read: fp32, or bf16 when the including file defines
 * KV_BF16 (paged_decode_bf16.c, paged_extend_bf16.c compile the same kernels a second time that way). Queries,
 * scores, softmax and outputs stay fp32 in both builds: a bf16 K or V value widens to fp32 exactly (its 16 bits
 * are the top half of the fp32 pattern), so the bf16 kernels differ from the fp32 ones only in the bytes they read,
 * half as many, which is what bounds decode attention.
 *
 *   kv_t              the cache's element type
 *   KV_NAME(name)     the exported symbol for this element type: name_f32 or name_bf16
 *   kv_float(x)       one element as fp32
 *   KV_LOAD16(p)      16 consecutive elements as one AVX-512 vector of fp32 (only where __AVX512F__)
 *   KV_LOAD8(p)       8 consecutive elements as one AVX2 vector of fp32 (only where __AVX2__)
 */
#ifndef DUET_KV_TYPE_H
#define DUET_KV_TYPE_H
#include <stdint.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#ifdef KV_BF16
typedef uint16_t kv_t;
#define KV_NAME(name) name##_bf16
static inline __attribute__((always_inline)) float kv_float(const kv_t x) {
    union {
        uint32_t u;
        float f;
    } c = {(uint32_t)x << 16};
    return c.f;
}
#if defined(__AVX512F__)
#define KV_LOAD16(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#endif
#if defined(__AVX2__)
#define KV_LOAD8(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#endif
#else
typedef float kv_t;
#define KV_NAME(name) name##_f32
#define kv_float(x) (x)
#define KV_LOAD16(p) _mm512_loadu_ps(p)
#define KV_LOAD8(p) _mm256_loadu_ps(p)
#endif

#endif
