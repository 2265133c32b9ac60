/*
 * helpers.h - small shared pieces of the C tests: building specs and schedules with a readable
 * failure message (the library's last error) when a call that must succeed fails.
 */
#ifndef ZB_TEST_HELPERS_H
#define ZB_TEST_HELPERS_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <cmocka.h>

#include "zbpp.h"
#include "backend/internal.h" /* the host half <-> float conversions */

/* Asserts a zbpp call returned ZB_OK, printing the status and zb_last_error() otherwise. */
#define ZB_ASSERT_OK(expr)                                                                         \
  do {                                                                                             \
    zb_status_t zb__t = (expr);                                                                    \
    if (zb__t != ZB_OK) fail_msg("%s -> %s: %s", #expr, zb_status_string(zb__t), zb_last_error()); \
  } while (0)

/* Asserts that a string contains a needle, printing both otherwise. */
#define ASSERT_CONTAINS(hay, needle)                                                               \
  do {                                                                                             \
    const char *zb__h = (hay), *zb__n = (needle);                                                  \
    if (!zb__h || !strstr(zb__h, zb__n))                                                           \
      fail_msg("expected \"%s\" in \"%s\"", zb__n, zb__h ? zb__h : "(null)");                    \
  } while (0)

/* Asserts a call returned a given status, printing both statuses and zb_last_error(). */
#define ASSERT_STATUS(expr, want)                                                                  \
  do {                                                                                             \
    zb_status_t zb__got = (expr), zb__want = (want);                                               \
    if (zb__got != zb__want)                                                                       \
      fail_msg("%s -> %d (%s), expected %d (%s); last error: %s", #expr, (int)zb__got,             \
               zb_status_string(zb__got), (int)zb__want, zb_status_string(zb__want),              \
               zb_last_error());                                                                   \
  } while (0)

/* A spec for kind/p/m/v with equal times 1,1,1, no comm, w = 0.5, no limit. */
zb_schedule_spec_t zb_test_spec(zb_kind_t kind, int p, int m, int v);

/* Reads a whole file into a malloc'd NUL-terminated buffer (NULL if it cannot). */
char *zb_test_read_file(const char *path, size_t *len);


/* ---- deterministic data (splitmix64) ------------------------------------------------------------ */

static inline uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/* A float in [-1, 1) with 24 significant bits, so it and its power-of-two multiples are exact. */
static inline float urand(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  uint64_t x = mix(mix(mix(mix(a) ^ b) ^ c) ^ d);
  return (float)((double)(x >> 40) / 8388608.0 - 1.0);
}

/* ---- elements of any dtype ---------------------------------------------------------------------- */

/* Element i of a buffer of dtype t, widened (exactly) to double. */
static inline double elem_get(const void *buf, zb_dtype_t t, int64_t i) {
  if (t == ZB_DTYPE_F32) return ((const float *)buf)[i];
  uint16_t v = ((const uint16_t *)buf)[i];
  return t == ZB_DTYPE_F16 ? zb__half_to_float(v) : zb__bf16_to_float(v);
}

/* Stores v rounded (to nearest even) to dtype t. */
static inline void elem_put(void *buf, zb_dtype_t t, int64_t i, float v) {
  if (t == ZB_DTYPE_F32)
    ((float *)buf)[i] = v;
  else
    ((uint16_t *)buf)[i] = t == ZB_DTYPE_F16 ? zb__float_to_half(v) : zb__float_to_bf16(v);
}

#endif
