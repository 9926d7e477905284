/* The paged decode kernel over a bf16 KV cache: paged_decode_bf16 (kv_type.h says what changes). */
#define KV_BF16 1
#include "paged_decode.c"
