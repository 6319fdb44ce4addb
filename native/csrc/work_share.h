/* Work laid end to end and shared among threads by its cost (a mixture of experts' products:
 * each expert's blocks of outputs, each block costing the expert's rows). */
#ifndef PAGODA_WORK_SHARE_H
#define PAGODA_WORK_SHARE_H

#include <stdint.h>

/* Of n items of cost each (> 0) laid out from cost `at`, the ones [*from, *to) that start in
 * [first, last): a thread's share when the threads take contiguous ranges of the total cost.
 * Every item falls to exactly one range. */
static inline void share_of(int64_t at, int64_t n, int64_t cost, int64_t first, int64_t last, int64_t *from,
                            int64_t *to) {
    const int64_t start = first > at ? (first - at + cost - 1) / cost : 0;
    const int64_t end = last > at ? (last - at + cost - 1) / cost : 0;
    *from = start < n ? start : n;
    *to = end < n ? end : n;
}

#endif /* PAGODA_WORK_SHARE_H */
