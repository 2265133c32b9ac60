/*
 * sbuf.c - the growable string the export writers build their output in.
 *
 * What this is: an append-only buffer that remembers an allocation failure instead of reporting it
 * at every call, so a writer can print freely and check once, in zb__sbuf_finish.
 * What this is not: a general string library. It never shrinks, and it is not safe to share
 * between threads. It also holds zb__nice_step, the axis-tick helper the text and SVG writers share.
 */
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "internal.h"

/* Makes room for `extra` more bytes plus the terminating NUL. Returns 0 (and sets oom) when it
 * cannot; after that every append is a no-op and finish reports the failure. */
static int reserve(zb__sbuf_t *b, size_t extra) {
  if (b->oom) return 0;
  if (extra > SIZE_MAX / 2 - b->len) {
    b->oom = 1;
    return 0;
  }
  size_t need = b->len + extra + 1;
  if (need <= b->cap) return 1;
  size_t cap = b->cap ? b->cap : 256;
  while (cap < need) cap *= 2;
  char *grown = realloc(b->buf, cap);
  if (!grown) {
    b->oom = 1;
    return 0;
  }
  b->buf = grown;
  b->cap = cap;
  return 1;
}

void zb__sbuf_printf(zb__sbuf_t *b, const char *fmt, ...) {
  if (b->oom) return;
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(NULL, 0, fmt, ap);
  va_end(ap);
  if (n < 0) {
    /* Only an encoding error can make vsnprintf fail; the writers print plain ASCII, so treat it
     * like a failed allocation rather than hand out a half-written result. */
    b->oom = 1;
    return;
  }
  if (!reserve(b, (size_t)n)) return;
  va_start(ap, fmt);
  vsnprintf(b->buf + b->len, b->cap - b->len, fmt, ap);
  va_end(ap);
  b->len += (size_t)n;
}

void zb__sbuf_putc(zb__sbuf_t *b, char c) {
  if (!reserve(b, 1)) return;
  b->buf[b->len++] = c;
  b->buf[b->len] = '\0';
}

zb_status_t zb__sbuf_finish(zb__sbuf_t *b, char **out, size_t *len) {
  /* An empty result is still a valid NUL-terminated string the caller frees. */
  if (!b->oom && !b->buf) reserve(b, 0);
  if (b->oom) {
    size_t had = b->len;
    free(b->buf);
    b->buf = NULL;
    b->len = b->cap = 0;
    *out = NULL;
    if (len) *len = 0;
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory writing the export (%zu bytes written so far)",
                   had);
  }
  b->buf[b->len] = '\0';
  *out = b->buf;
  if (len) *len = b->len;
  b->buf = NULL;
  b->len = b->cap = 0;
  return ZB_OK;
}

double zb__nice_step(double raw) {
  if (!(raw > 0) || isinf(raw)) return 1;
  double mag = pow(10, floor(log10(raw)));
  double f = raw / mag;
  return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * mag;
}
