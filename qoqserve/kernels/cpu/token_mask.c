/* Token bitmasks of constrained decoding applied to a batch's logits in one
 * call: for each listed row, every token whose bit is 0 gets -inf. Bit t of
 * a row is bit t % 32 of its 32-bit word t / 32 (xgrammar's layout). A word
 * of all ones (every token allowed) costs one compare, a word of zeros one
 * run of 32 stores; only mixed words go bit by bit. One thread: a batch's
 * masks are a few MB of stores (~0.1 ms), less than waking a thread team
 * costs on a busy machine.
 */
#include <math.h>
#include <stdint.h>

void apply_token_bitmask(float *logits, int64_t row_stride, const int64_t *rows, int64_t n_rows,
                         const int32_t *bitmask, int64_t words, int64_t vocab) {
    for (int64_t r = 0; r < n_rows; r++) {
        float *row = logits + rows[r] * row_stride;
        const uint32_t *mask = (const uint32_t *)bitmask + r * words;
        for (int64_t w = 0; w < words; w++) {
            uint32_t bits = mask[w];
            if (bits == 0xffffffffu) continue;
            int64_t base = w * 32, n = vocab - base < 32 ? vocab - base : 32;
            if (bits == 0) {
                for (int64_t k = 0; k < n; k++) row[base + k] = -INFINITY;
                continue;
            }
            for (int64_t k = 0; k < n; k++)
                if (!((bits >> k) & 1u)) row[base + k] = -INFINITY;
        }
    }
}
