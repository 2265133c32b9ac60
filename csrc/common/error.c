/*
 * error.c - status strings, the per-thread last-error buffer, version and zb_free.
 *
 * The only mutable global state in the library is the thread-local buffer here (and the cached
 * ZBPP_DEBUG switch, written once).
 */
#include "error.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static _Thread_local char last_error[2048];

const char *zb_status_string(zb_status_t status) {
  switch (status) {
#define ZB_X_CASE(name, value, text)                                                               \
  case name:                                                                                       \
    return text;
    ZB_STATUS_LIST(ZB_X_CASE)
#undef ZB_X_CASE
  }
  return "unknown status";
}

const char *zb_last_error(void) { return last_error; }

/* Whether messages start with the library's source position ("runner.c:602: "): only when the
 * environment sets ZBPP_DEBUG (to anything but "" or "0"), for whoever debugs the library. A user
 * reads what failed and why; the position means nothing to them, and it repeats in every rank's
 * message a failure quotes. Read once: a race between two first reads writes the same value. */
static int debug_positions(void) {
  static int cached = -1;
  if (cached < 0) {
    const char *v = getenv("ZBPP_DEBUG");
    cached = v && v[0] && strcmp(v, "0") != 0;
  }
  return cached;
}

zb_status_t zb__set_error(zb_status_t status, const char *file, int line, const char *fmt, ...) {
  int n = 0;
  if (debug_positions()) {
    /* Only the file's base name: full build paths make messages long and leak the build tree. */
    const char *base = strrchr(file, '/');
    base = base ? base + 1 : file;
    n = snprintf(last_error, sizeof last_error, "%s:%d: ", base, line);
    if (n < 0 || (size_t)n >= sizeof last_error) n = 0;
  }
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error + n, sizeof last_error - (size_t)n, fmt, ap);
  va_end(ap);
  return status;
}

void zb__clear_error(void) { last_error[0] = '\0'; }

const char *zb__error_body(void) {
  /* Skip "name.c:123: " when the message starts with one; other text comes back unchanged. */
  const char *colon = strchr(last_error, ':');
  if (!colon || colon == last_error) return last_error;
  const char *p = colon + 1;
  if (*p < '0' || *p > '9') return last_error;
  while (*p >= '0' && *p <= '9') p++;
  if (p[0] != ':' || p[1] != ' ') return last_error;
  for (const char *q = last_error; q < colon; q++)
    if (*q == ' ') return last_error;
  return p + 2;
}

void zb__error_restore(const char *message) {
  if (message != last_error) snprintf(last_error, sizeof last_error, "%s", message);
}

#define ZB__STR2(x) #x
#define ZB__STR(x) ZB__STR2(x)

const char *zb_version(void) {
  return ZB__STR(ZB_VERSION_MAJOR) "." ZB__STR(ZB_VERSION_MINOR) "." ZB__STR(ZB_VERSION_PATCH);
}

int zb_version_code(void) { return ZB_VERSION_CODE; }

void zb_free(void *ptr) { free(ptr); }
