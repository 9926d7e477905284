/* The paged extend kernel over a bf16 KV cache: paged_extend_bf16 (kv_type.h says what changes). */
#define KV_BF16 1
#include "paged_extend.c"
