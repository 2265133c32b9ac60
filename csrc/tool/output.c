/*
 * output.c - what the zbpp tool puts in front of a user: library messages without the C source
 * positions in them.
 *
 * What this is not: a change to zb_last_error(), whose "file.c:123: " stays for developers and
 * for callers of the library; only the tool's terminal output drops it.
 */
#include <stddef.h>
#include <string.h>

#include "tool.h"
#include "zbpp.h"

/* ---- messages ---------------------------------------------------------------------------------- */

static int name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '-' || c == '+' || c == '.';
}

/* The length of "name.c:123: " at s (also .cu, .cpp, .cc, .h), or 0 when s does not start with one. */
static size_t source_pos_len(const char *s) {
  size_t n = 0;
  while (name_char(s[n])) n++;
  static const char *const exts[] = {".c", ".cu", ".cpp", ".cc", ".h"};
  int is_source = 0;
  for (size_t k = 0; k < sizeof exts / sizeof exts[0]; k++) {
    size_t e = strlen(exts[k]);
    if (n > e && !strncmp(s + n - e, exts[k], e)) is_source = 1;
  }
  if (!is_source || s[n] != ':' || s[n + 1] < '0' || s[n + 1] > '9') return 0;
  n++;
  while (s[n] >= '0' && s[n] <= '9') n++;
  if (s[n] != ':') return 0;
  n++;
  return s[n] == ' ' ? n + 1 : n;
}

const char *zb__tool_plain(const char *msg) {
  /* zb_last_error() starts with "file.c:123: " for developers, and a message that quotes another
   * (a rank's failure inside the runner's) carries more of them inside: drop every one. */
  static char buf[4096];
  size_t o = 0;
  if (!msg) return "";
  for (size_t i = 0; msg[i] && o + 1 < sizeof buf;) {
    size_t skip = (i == 0 || !name_char(msg[i - 1])) ? source_pos_len(msg + i) : 0;
    if (skip) {
      i += skip;
    } else {
      buf[o++] = msg[i++];
    }
  }
  buf[o] = '\0';
  return buf;
}

const char *zb__tool_error(void) { return zb__tool_plain(zb_last_error()); }
