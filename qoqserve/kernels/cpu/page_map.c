/* A step's page tables and slots seen from the sliding layers' own page pool
 * (engine/window_pages.py): each block id goes through the pool's map. One
 * call per step, before the layers, so a captured step replays it too. */
#include <stdint.h>

/* tables_out[i] = pages[tables[i]] (n_tables entries); slots_out[i] =
 * pages[slots[i] / block_size] * block_size + slots[i] % block_size. Ids are
 * the engine's own, within the map (the padding rows' block included). */
void page_map(const int64_t *pages, const int64_t *tables, int64_t n_tables, int64_t *tables_out,
              const int64_t *slots, int64_t n_slots, int64_t *slots_out, int64_t block_size) {
    for (int64_t i = 0; i < n_tables; i++) tables_out[i] = pages[tables[i]];
    for (int64_t i = 0; i < n_slots; i++) {
        const int64_t s = slots[i];
        slots_out[i] = pages[s / block_size] * block_size + s % block_size;
    }
}
