/* Structured outputs: a batch's token bitmasks applied to its logits in one pass.
 *
 * Row r of `bitmask` (words uint32, bit t % 32 of word t / 32: token t allowed) masks logits
 * row rows[r]: every disallowed token's logit becomes -inf, the others are left as they are.
 * The torch version unpacks the bits into a [R, V] bool tensor first and then fills, several
 * passes over R x V; here whole words are decided at once (a grammar usually allows few
 * tokens, so most words are 0: a run of -inf), which is what makes it cheap on large vocabularies. */
#include <math.h>
#include <stdint.h>

void apply_token_bitmask(float *logits, int64_t row_stride, const int64_t *rows, int64_t n_rows,
                         const uint32_t *bitmask, int64_t words, int64_t vocab) {
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n_rows; r++) {
        float *row = logits + rows[r] * row_stride;
        const uint32_t *bits = bitmask + r * words;
        for (int64_t w = 0; w < words; w++) {
            uint32_t word = bits[w];
            if (word == 0xFFFFFFFFu) continue;
            int64_t base = w * 32, end = vocab - base < 32 ? vocab - base : 32;
            for (int64_t b = 0; b < end; b++)
                if (!((word >> b) & 1u)) row[base + b] = -INFINITY;
        }
    }
}
