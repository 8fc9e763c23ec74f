/* A captured decode step's inputs moved on by one token, in place, from the
 * token the step chose for each row (its greedy argmax): a plan of the step
 * and then this call, replayed n times, decodes n tokens with nothing run
 * from Python in between (engine/burst.py). */
#include <stdint.h>

/* Rows 0..rows-1 of the step's inputs: history[*step * rows + i], ids[i] =
 * chosen[i]; positions[i] and context_lens[i] one more; slots[i] the new
 * position's slot in the row's block table (`width` pages of block_size
 * slots, rows `width` apart), or pad_slot past the table (a step that will
 * not run: the last one of a burst moves on too). Then *step += 1.
 * Returns 0, or -1 when *step is already max_steps (nothing written). */
int decode_advance(const int64_t *chosen, int64_t *ids, int64_t *positions, int64_t *context_lens,
                   int64_t *slots, const int64_t *tables, int64_t width, int64_t block_size,
                   int64_t pad_slot, int64_t rows, int64_t *history, int64_t *step, int64_t max_steps) {
    if (*step < 0 || *step >= max_steps) return -1;
    for (int64_t i = 0; i < rows; i++) {
        const int64_t pos = positions[i] + 1, page = pos / block_size;
        history[*step * rows + i] = ids[i] = chosen[i];
        positions[i] = pos;
        context_lens[i] = pos + 1;
        slots[i] = page < width ? tables[i * width + page] * block_size + pos % block_size : pad_slot;
    }
    *step += 1;
    return 0;
}
