/* The layer checksum: a wrapping sum of little-endian u64 words, run at memory speed. */
#include "epd.h"

#include <string.h>

/* Loads one little-endian u64 from any address; memcpy keeps unaligned loads legal. */
static inline uint64_t load_le64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, sizeof v);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

uint64_t epd_get_le64(const unsigned char *in) { return load_le64(in); }

uint32_t epd_get_le32(const unsigned char *in)
{
    return (uint32_t)in[0] | (uint32_t)in[1] << 8 | (uint32_t)in[2] << 16 | (uint32_t)in[3] << 24;
}

void epd_put_le32(unsigned char *out, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        out[i] = (unsigned char)(v >> (8 * i));
}

void epd_put_le64(unsigned char *out, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        out[i] = (unsigned char)(v >> (8 * i));
}

void epd_put_frame_header(unsigned char *out, size_t payload_len, unsigned kind)
{
    epd_put_le32(out, (uint32_t)(payload_len + 1));
    out[4] = (unsigned char)kind;
}

void epd_put_layer_header(unsigned char *out, uint32_t layer, uint32_t rows, uint64_t checksum)
{
    epd_put_le32(out, layer);
    epd_put_le32(out + 4, rows);
    epd_put_le64(out + 8, checksum);
}

/* Eight independent accumulators so the adds do not serialise on one register
   and the compiler can vectorise the block loop; unsigned adds wrap mod 2^64,
   which is exactly the checksum's definition, and the order of adds is free. */
uint64_t epd_layer_sum(const void *data, size_t len)
{
    const unsigned char *p = data;
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;
    size_t i = 0;
    for (; i + 64 <= len; i += 64) {
        a0 += load_le64(p + i);
        a1 += load_le64(p + i + 8);
        a2 += load_le64(p + i + 16);
        a3 += load_le64(p + i + 24);
        a4 += load_le64(p + i + 32);
        a5 += load_le64(p + i + 40);
        a6 += load_le64(p + i + 48);
        a7 += load_le64(p + i + 56);
    }
    for (; i + 8 <= len; i += 8)
        a0 += load_le64(p + i);
    if (i < len) {
        /* The short tail counts as a word zero-padded at its high end. */
        unsigned char tail[8] = {0};
        memcpy(tail, p + i, len - i);
        a1 += load_le64(tail);
    }
    return ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7));
}
