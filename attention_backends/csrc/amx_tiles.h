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

static inline void configure_tiles(void) {
    struct tile_config config;
    memset(&config, 0, sizeof(config));
    config.palette = 1;
    for (int t = 0; t < 8; t++) config.rows[t] = 16, config.colsb[t] = 64;
    _tile_loadconfig(&config);
}

int pagoda_amx_permitted(void);

#endif
