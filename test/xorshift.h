/* The tests' random numbers: xorshift64 (Marsaglia's shifts 13, 7, 17) on a state each program, or
   each problem, seeds for itself, so that a failure comes back from its seed alone. C and C++. */
#ifndef PR_TEST_XORSHIFT_H
#define PR_TEST_XORSHIFT_H
#include <math.h>
#include <stdint.h>

static inline uint64_t test_bits(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}
/* (-1, 1): the top 53 bits as a multiple of 2^-53 in [0, 1), doubled, less 1 */
static inline double test_uniform(uint64_t *s) { return ((test_bits(s) >> 11) / 9007199254740992.0) * 2 - 1; }
/* a standard normal value by Box-Muller's cosine, from two uniforms (u kept above 0 for its log) */
static inline double test_gaussian(uint64_t *s) {
    const double u = 0.5 * (test_uniform(s) + 1), v = 0.5 * (test_uniform(s) + 1);
    return sqrt(-2 * log(u > 1e-300 ? u : 1e-300)) * cos(6.283185307179586 * v);
}
#endif
