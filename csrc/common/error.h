/*
 * error.h - the per-thread error message and the check macros every source file uses.
 *
 * What this is: zb__set_error() formats "file:line: message" into a thread-local buffer that
 * zb_last_error() returns, and ZB_FAIL/ZB_CHECK/ZB_CHECK_GOTO turn that into control flow.
 * What this is not: logging. Nothing here prints; the library never writes to stderr by itself.
 */
#ifndef ZB_COMMON_ERROR_H
#define ZB_COMMON_ERROR_H

#include "zbpp.h"

#if defined(__GNUC__)
#define ZB__PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define ZB__PRINTF(a, b)
#endif

/* Records the message for zb_last_error() and returns status, so callers can write
 * `return zb__set_error(...)`. */
zb_status_t zb__set_error(zb_status_t status, const char *file, int line, const char *fmt, ...)
    ZB__PRINTF(4, 5);
/* Forgets the previous message (successful public calls do not clear it, as with errno). */
void zb__clear_error(void);
/* The last message without its leading "file.c:123: ", for quoting it inside a wider one. */
const char *zb__error_body(void);
/* Puts back a message saved earlier, verbatim (cleanup code may have overwritten it). */
void zb__error_restore(const char *message);

#define ZB_FAIL(status, ...) zb__set_error((status), __FILE__, __LINE__, __VA_ARGS__)

/* Propagates a failing status; the message of the callee stays. */
#define ZB_CHECK(expr)                                                                             \
  do {                                                                                             \
    zb_status_t zb__s = (expr);                                                                    \
    if (zb__s != ZB_OK) return zb__s;                                                              \
  } while (0)

/* Same, but jumps to a cleanup label with the status stored in `st`. */
#define ZB_CHECK_GOTO(expr, st, label)                                                             \
  do {                                                                                             \
    (st) = (expr);                                                                                 \
    if ((st) != ZB_OK) goto label;                                                                 \
  } while (0)

#define ZB_ARG_NOT_NULL(p)                                                                         \
  do {                                                                                             \
    if ((p) == NULL) return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "%s: argument '%s' is NULL", __func__, #p); \
  } while (0)

#endif /* ZB_COMMON_ERROR_H */
