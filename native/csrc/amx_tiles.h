/*
 * The AMX tile configuration both tile kernels use (packed_linear.c, tile_attention.c): all 8
 * tiles 16 rows x 64 bytes (palette 1). A thread loads it before its first tile instruction
 * and releases the tiles (_tile_release) when done. Linux must first have let the process use
 * the tiles' state: pagoda_amx_permitted() in packed_linear.c asks once.
 */
#ifndef PAGODA_AMX_TILES_H
#define PAGODA_AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* NOTE: a constant in memory, not a struct filled on the stack: GCC 12 does not count all 64
 * bytes as read by ldtilecfg, and with configure_tiles inlined into a larger function (a
 * reworked quant_linear_tiles, 2026-12-05, not kept) it dropped the stores of rows and colsb;
 * ldtilecfg then faulted on the stack's garbage. */
static const struct tile_config TILE_CONFIG __attribute__((aligned(64))) = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

static inline void configure_tiles(void) { _tile_loadconfig(&TILE_CONFIG); }

int pagoda_amx_permitted(void);

#endif
