/* AMX tiles (Intel Xeon from Sapphire Rapids on) for the kernels that use them (paged_extend.c, bf16_linear.c):
 *
 *   AMX_BUILT          1 where the compiler targets AMX-BF16 (and AVX512-BF16, which the kernels use beside it)
 *   amx_permitted()    1 once Linux lends this process the tile registers (arch_prctl); oneDNN asks too, but only
 *                      at its first AMX call, which may come after ours
 *   amx_configure(m)   every tile 64 bytes wide; tiles 0-4 (sums and the left operand) m rows, 5-7 16 rows.
 *                      Per thread, at the start of each parallel region: oneDNN's calls on torch's threads leave
 *                      their own shapes, and reconfigure for their own calls
 */
#ifndef DUET_AMX_H
#define DUET_AMX_H
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define AMX_BUILT 1
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static int amx_permitted(void) {
    static int permitted = -1;
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return permitted;
}

static inline void amx_configure(const int m) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((packed, aligned(64))) cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = (uint8_t)(t < 5 ? m : 16);
    }
    _tile_loadconfig(&cfg);
}
#else
#define AMX_BUILT 0
#endif
#endif
