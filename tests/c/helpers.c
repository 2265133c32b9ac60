/* helpers.c - see helpers.h. */
#include "helpers.h"

#include <stdio.h>
#include <stdlib.h>

zb_schedule_spec_t zb_test_spec(zb_kind_t kind, int p, int m, int v) {
  zb_schedule_spec_t spec = ZB_SCHEDULE_SPEC_INIT;
  spec.kind = kind;
  spec.ranks = p;
  spec.microbatches = m;
  spec.chunks = v;
  return spec;
}

char *zb_test_read_file(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *buf = malloc((size_t)n + 1);
  if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
    free(buf);
    buf = NULL;
  }
  fclose(f);
  if (buf) {
    buf[n] = '\0';
    if (len) *len = (size_t)n;
  }
  return buf;
}
