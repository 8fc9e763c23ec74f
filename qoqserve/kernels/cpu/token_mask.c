/* Token bitmasks of constrained decoding applied to a batch's logits in one
 * call: for each listed row, every token whose bit is 0 gets -inf. Bit t of
 * a row is bit t % 32 of its 32-bit word t / 32 (xgrammar's layout). A word
 * of all ones (every token allowed) costs one compare; with AVX-512 any
 * other word is two masked stores of -inf, else the scalar loop below. One
 * thread: a batch's masks are a few MB of stores, less than waking a thread
 * team costs on a busy machine.
 *
 * rows_left_empty then names the rows where nothing is left to pick (every
 * logit -inf). Each row is scanned only up to its first logit that is not
 * -inf, which is almost always near the start, where torch's
 * isneginf(logits[rows]).all(1) copies and tests every row whole.
 */
#include <math.h>
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

void apply_token_bitmask(float *logits, int64_t row_stride, const int64_t *rows, int64_t n_rows,
                         const int32_t *bitmask, int64_t words, int64_t vocab) {
#ifdef __AVX512F__
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
#endif
    for (int64_t r = 0; r < n_rows; r++) {
        float *row = logits + rows[r] * row_stride;
        const uint32_t *mask = (const uint32_t *)bitmask + r * words;
        int64_t full_words = vocab / 32;
        for (int64_t w = 0; w * 32 < vocab && w < words; w++) {
            uint32_t bits = mask[w];
            int64_t base = w * 32, n = w < full_words ? 32 : vocab - base;
            uint32_t inside = n == 32 ? 0xffffffffu : (1u << n) - 1u;
            uint32_t banned = ~bits & inside;
            if (banned == 0) continue;
#ifdef __AVX512F__
            _mm512_mask_storeu_ps(row + base, (__mmask16)(banned & 0xffffu), ninf);
            _mm512_mask_storeu_ps(row + base + 16, (__mmask16)(banned >> 16), ninf);
#else
            for (int64_t k = 0; k < n; k++)
                if ((banned >> k) & 1u) row[base + k] = -INFINITY;
#endif
        }
    }
}

int64_t rows_left_empty(const float *logits, int64_t row_stride, const int64_t *rows, int64_t n_rows,
                        int64_t vocab, int64_t *empty) {
    int64_t count = 0;
    for (int64_t r = 0; r < n_rows; r++) {
        const float *row = logits + rows[r] * row_stride;
        int64_t t = 0;
        while (t < vocab && row[t] == -INFINITY) t++;
        if (t == vocab) empty[count++] = rows[r];
    }
    return count;
}
