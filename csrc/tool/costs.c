/*
 * costs.c - the tool's reader for per-stage cost files (`--stage-times FILE`): a small, strict JSON
 * reader and the rules of the "zbpp-costs" format, version 1 (docs/tool.md, "Cost files"):
 *
 *   {"format": "zbpp-costs", "version": 1, "unit": "ms", "ranks": 2, "chunks": 2, "placement": "v",
 *    "time_f": [S numbers], "time_b": [S], "time_w": [S], "time_bw": [S] or null,
 *    "time_comm": 0.05, "w_share": 0.5, "mem_f_bytes": [S numbers],
 *    "time_offload": [S] or null, "time_reload": [S] or null}
 *
 * The arrays are per stage (stage s in zbpp numbering, S = ranks * chunks) and hold the absolute
 * time of one microbatch through that stage: exactly what zb_schedule_spec_t.stage_time_* means,
 * not a per-rank time divided by v. Only time_f, time_b and time_w are required; null stands for a
 * missing optional key; keys this version does not know are skipped, whatever their value, so a
 * newer writer can add some. The Python profiler writes the same format, so the rules here are a
 * contract: change them only together with it.
 *
 * What this is not: a JSON library or part of the library's ABI. It reads one object of this shape
 * and nothing else, it never calls exit, and it does no I/O: the caller reads the file, and every
 * failure comes back as a message ("FILE:LINE:COLUMN: ..." for malformed JSON).
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tool.h"

/* The library's own limit on p * v; also keeps a hostile file from asking for huge arrays. */
#define MAX_STAGES 65536
/* Unknown keys may hold nested values; a limit keeps the recursion in skip_value bounded. */
#define MAX_DEPTH 64

typedef struct {
  const char *name; /* the file name, for messages */
  const char *s;    /* the text, not NUL-terminated */
  size_t n, i;      /* its length and the read position */
  char *err;
  size_t err_len;
} reader_t;

static void message(char *err, size_t err_len, const char *fmt, ...) ZB__TOOL_PRINTF(3, 4);
static void message(char *err, size_t err_len, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  if (err_len) vsnprintf(err, err_len, fmt, ap);
  va_end(ap);
}

/* "NAME:LINE:COLUMN: what" for the byte at offset `at`; returns 0 for callers to return. */
static int fail_at(reader_t *r, size_t at, const char *fmt, ...) ZB__TOOL_PRINTF(3, 4);
static int fail_at(reader_t *r, size_t at, const char *fmt, ...) {
  int line = 1;
  size_t col = 1;
  for (size_t k = 0; k < at && k < r->n; k++) {
    if (r->s[k] == '\n') line++, col = 1;
    else col++;
  }
  char what[384];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  message(r->err, r->err_len, "%s:%d:%zu: %s", r->name, line, col, what);
  return 0;
}

static int starts_with(const reader_t *r, const char *word) {
  size_t n = strlen(word);
  return r->n - r->i >= n && !memcmp(r->s + r->i, word, n);
}

/* What sits at the read position, for "expected X, got Y" messages. */
static const char *describe(const reader_t *r) {
  if (r->i >= r->n) return "the end of the file";
  char c = r->s[r->i];
  switch (c) {
    case '{': return "an object";
    case '[': return "an array";
    case '"': return "a string";
    case ',': return "','";
    case ':': return "':'";
    case ']': return "']'";
    case '}': return "'}'";
    default: break;
  }
  if (c == '-' || (c >= '0' && c <= '9')) return "a number";
  if (starts_with(r, "true") || starts_with(r, "false")) return "true/false";
  if (starts_with(r, "null")) return "null";
  return "something that is not JSON";
}

static void skip_ws(reader_t *r) {
  while (r->i < r->n && (r->s[r->i] == ' ' || r->s[r->i] == '\t' || r->s[r->i] == '\n' ||
                         r->s[r->i] == '\r'))
    r->i++;
}

static int peek(reader_t *r, char c) {
  skip_ws(r);
  return r->i < r->n && r->s[r->i] == c;
}

static int expect(reader_t *r, char c, const char *where) {
  if (peek(r, c)) {
    r->i++;
    return 1;
  }
  return fail_at(r, r->i, "expected '%c' %s, got %s", c, where, describe(r));
}

/* Consumes `word` if the text continues with it. */
static int literal(reader_t *r, const char *word) {
  if (!starts_with(r, word)) return 0;
  r->i += strlen(word);
  return 1;
}

static int hex4(reader_t *r, unsigned *out) {
  if (r->n - r->i < 4) return 0;
  unsigned x = 0;
  for (int k = 0; k < 4; k++) {
    char c = r->s[r->i + k];
    x <<= 4;
    if (c >= '0' && c <= '9') x |= (unsigned)(c - '0');
    else if (c >= 'a' && c <= 'f') x |= (unsigned)(c - 'a' + 10);
    else if (c >= 'A' && c <= 'F') x |= (unsigned)(c - 'A' + 10);
    else return 0;
  }
  r->i += 4;
  *out = x;
  return 1;
}

/* Appends a byte to a bounded buffer; *len counts every byte, so a caller can tell truncation. */
static void put(char *buf, size_t cap, size_t *len, unsigned char c) {
  if (*len + 1 < cap) buf[*len] = (char)c;
  (*len)++;
}

/* Reads a string at the read position into buf (UTF-8, NUL-terminated, truncated to cap - 1
 * bytes); *len gets the full decoded length, so a truncated string never equals a short name. */
static int read_string(reader_t *r, char *buf, size_t cap, size_t *len) {
  size_t start = r->i;
  *len = 0;
  if (!expect(r, '"', "to start a string")) return 0;
  for (;;) {
    if (r->i >= r->n) return fail_at(r, start, "string not closed before the end of the file");
    unsigned char c = (unsigned char)r->s[r->i];
    if (c == '"') {
      r->i++;
      break;
    }
    if (c < 0x20)
      return fail_at(r, r->i, "control character 0x%02x in a string (write it as \\u%04x)", c, c);
    if (c != '\\') {
      put(buf, cap, len, c);
      r->i++;
      continue;
    }
    size_t esc = r->i++;
    char e = r->i < r->n ? r->s[r->i++] : '\0';
    const char *from = "\"\\/bfnrt", *to = "\"\\/\b\f\n\r\t";
    const char *hit = e ? strchr(from, e) : NULL;
    if (hit) {
      put(buf, cap, len, (unsigned char)to[hit - from]);
      continue;
    }
    unsigned u, lo;
    if (e != 'u' || !hex4(r, &u))
      return fail_at(r, esc, "bad escape in a string (JSON allows \\\" \\\\ \\/ \\b \\f \\n "
                             "\\r \\t \\uXXXX)");
    if (u >= 0xDC00 && u <= 0xDFFF)
      return fail_at(r, esc, "\\u%04x is the second half of a surrogate pair, alone", u);
    if (u >= 0xD800 && u <= 0xDBFF) {
      if (!literal(r, "\\u") || !hex4(r, &lo) || lo < 0xDC00 || lo > 0xDFFF)
        return fail_at(r, esc, "\\u%04x starts a surrogate pair but no low surrogate follows", u);
      u = 0x10000 + ((u - 0xD800) << 10) + (lo - 0xDC00);
    }
    if (u < 0x80) {
      put(buf, cap, len, (unsigned char)u);
    } else if (u < 0x800) {
      put(buf, cap, len, (unsigned char)(0xC0 | (u >> 6)));
      put(buf, cap, len, (unsigned char)(0x80 | (u & 0x3F)));
    } else if (u < 0x10000) {
      put(buf, cap, len, (unsigned char)(0xE0 | (u >> 12)));
      put(buf, cap, len, (unsigned char)(0x80 | ((u >> 6) & 0x3F)));
      put(buf, cap, len, (unsigned char)(0x80 | (u & 0x3F)));
    } else {
      put(buf, cap, len, (unsigned char)(0xF0 | (u >> 18)));
      put(buf, cap, len, (unsigned char)(0x80 | ((u >> 12) & 0x3F)));
      put(buf, cap, len, (unsigned char)(0x80 | ((u >> 6) & 0x3F)));
      put(buf, cap, len, (unsigned char)(0x80 | (u & 0x3F)));
    }
  }
  if (cap) buf[*len < cap ? *len : cap - 1] = '\0';
  return 1;
}

static int is_digit(const reader_t *r) {
  return r->i < r->n && r->s[r->i] >= '0' && r->s[r->i] <= '9';
}

/* Is there a number (or NaN/Infinity) at the read position? */
static int at_number(reader_t *r) {
  skip_ws(r);
  if (r->i >= r->n) return 0;
  char c = r->s[r->i];
  return c == '-' || (c >= '0' && c <= '9') || c == 'N' || c == 'I';
}

/* A number by JSON's grammar, -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?, converted by strtod,
 * which rounds correctly: a value written with %.17g (or Python's repr) reads back to the same
 * double. NaN, Infinity and -Infinity are not JSON, but Python's json module writes them for
 * non-finite floats; they are read here so that the caller's range check can name the key and
 * index instead of reporting a syntax error. */
static int read_number(reader_t *r, double *out) {
  skip_ws(r);
  size_t start = r->i;
  if (literal(r, "NaN")) return *out = NAN, 1;
  if (literal(r, "Infinity")) return *out = INFINITY, 1;
  if (literal(r, "-Infinity")) return *out = -INFINITY, 1;
  if (r->i < r->n && r->s[r->i] == '-') r->i++;
  if (!is_digit(r)) return fail_at(r, start, "expected a number, got %s", describe(r));
  if (r->s[r->i] == '0') {
    r->i++;
    if (is_digit(r)) return fail_at(r, start, "a number may not start with 0 followed by digits");
  } else {
    while (is_digit(r)) r->i++;
  }
  if (r->i < r->n && r->s[r->i] == '.') {
    r->i++;
    if (!is_digit(r)) return fail_at(r, r->i, "expected a digit after the decimal point");
    while (is_digit(r)) r->i++;
  }
  if (r->i < r->n && (r->s[r->i] == 'e' || r->s[r->i] == 'E')) {
    r->i++;
    if (r->i < r->n && (r->s[r->i] == '+' || r->s[r->i] == '-')) r->i++;
    if (!is_digit(r)) return fail_at(r, r->i, "expected a digit in the exponent");
    while (is_digit(r)) r->i++;
  }
  /* The text is not NUL-terminated, and strtod alone would accept more than JSON (hex, "inf"):
   * convert a copy of exactly the span the grammar above accepted. */
  size_t len = r->i - start;
  char small[64], *copy = len < sizeof small ? small : malloc(len + 1);
  if (!copy) return fail_at(r, start, "out of memory reading a number");
  memcpy(copy, r->s + start, len);
  copy[len] = '\0';
  *out = strtod(copy, NULL); /* overflow gives +-HUGE_VAL (inf), which the range checks catch */
  if (copy != small) free(copy);
  return 1;
}

/* Skips one value of any type: what an unknown key holds. */
static int skip_value(reader_t *r, int depth) {
  if (depth > MAX_DEPTH) return fail_at(r, r->i, "values nested more than %d deep", MAX_DEPTH);
  skip_ws(r);
  char tmp[2];
  size_t len;
  if (peek(r, '"')) return read_string(r, tmp, sizeof tmp, &len);
  if (literal(r, "true") || literal(r, "false") || literal(r, "null")) return 1;
  if (at_number(r)) {
    double x;
    return read_number(r, &x);
  }
  int object = peek(r, '{');
  if (!object && !peek(r, '[')) return fail_at(r, r->i, "expected a value, got %s", describe(r));
  r->i++;
  char close = object ? '}' : ']';
  if (peek(r, close)) return r->i++, 1;
  for (;;) {
    if (object && !(read_string(r, tmp, sizeof tmp, &len) && expect(r, ':', "after a key")))
      return 0;
    if (!skip_value(r, depth + 1)) return 0;
    if (peek(r, ',')) {
      r->i++;
      if (peek(r, close))
        return fail_at(r, r->i, "'%c' after ',': JSON allows no trailing comma", close);
      continue;
    }
    if (peek(r, close)) return r->i++, 1;
    return fail_at(r, r->i, "expected ',' or '%c' %s, got %s", close,
                   object ? "after a value in an object" : "after an array element", describe(r));
  }
}

/* Reads `null` if it is there: an optional key given as null is the same as a missing one. */
static int read_null(reader_t *r) {
  skip_ws(r);
  return literal(r, "null");
}

/* Reads an array of numbers for `key`; each must be finite and >= 0 (times and byte counts). */
static int read_array(reader_t *r, const char *key, double **out, int *count) {
  size_t open = (skip_ws(r), r->i);
  if (!peek(r, '['))
    return fail_at(r, open, "\"%s\" must be an array of numbers (one per stage), got %s", key,
                   describe(r));
  r->i++;
  int n = 0, cap = 0;
  double *a = NULL;
  if (peek(r, ']')) {
    r->i++;
    return fail_at(r, open, "\"%s\" is empty; it needs one value per stage", key);
  }
  for (;;) {
    size_t at = (skip_ws(r), r->i);
    if (!at_number(r)) {
      free(a);
      return fail_at(r, at, "%s[%d] must be a number, got %s", key, n, describe(r));
    }
    if (n == MAX_STAGES) {
      free(a);
      return fail_at(r, at, "\"%s\" has more than %d values; zbpp handles at most %d stages", key,
                     MAX_STAGES, MAX_STAGES);
    }
    if (n == cap) {
      cap = cap ? 2 * cap : 16;
      double *grown = realloc(a, (size_t)cap * sizeof *a);
      if (!grown) {
        free(a);
        return fail_at(r, at, "out of memory reading \"%s\"", key);
      }
      a = grown;
    }
    if (!read_number(r, &a[n])) {
      free(a);
      return 0;
    }
    if (!isfinite(a[n]) || a[n] < 0) {
      double x = a[n];
      free(a);
      return fail_at(r, at, "%s[%d] is %g; %s must be finite and >= 0", key, n, x,
                     strncmp(key, "time", 4) ? "sizes" : "times");
    }
    n++;
    if (peek(r, ',')) {
      r->i++;
      if (!peek(r, ']')) continue;
      free(a);
      return fail_at(r, r->i, "']' after ',' in \"%s\": JSON allows no trailing comma", key);
    }
    if (peek(r, ']')) {
      r->i++;
      break;
    }
    free(a);
    return fail_at(r, r->i, "expected ',' or ']' after %s[%d], got %s", key, n - 1, describe(r));
  }
  *out = a;
  *count = n;
  return 1;
}

/* A whole number >= 1 (ranks, chunks). */
static int read_count(reader_t *r, const char *key, int *out) {
  size_t at = (skip_ws(r), r->i);
  double x;
  if (!at_number(r))
    return fail_at(r, at, "\"%s\" must be a whole number >= 1, got %s", key, describe(r));
  if (!read_number(r, &x)) return 0;
  if (!(x >= 1 && x <= MAX_STAGES && x == floor(x)))
    return fail_at(r, at, "\"%s\" is %g; it must be a whole number from 1 to %d", key, x,
                   MAX_STAGES);
  *out = (int)x;
  return 1;
}

static int read_scalar(reader_t *r, const char *key, double *out) {
  size_t at = (skip_ws(r), r->i);
  if (!at_number(r)) return fail_at(r, at, "\"%s\" must be a number, got %s", key, describe(r));
  return read_number(r, out);
}

/* The keys of version 1. Each may appear once: a repeated key would leave its meaning to whichever
 * reader the file happens to meet. */
enum {
  K_FORMAT, K_VERSION, K_UNIT, K_RANKS, K_CHUNKS, K_PLACEMENT, K_TIME_F, K_TIME_B, K_TIME_W,
  K_TIME_BW, K_TIME_COMM, K_W_SHARE, K_MEM_F_BYTES, K_TIME_OFFLOAD, K_TIME_RELOAD, K_COUNT
};
static const char *const KEYS[K_COUNT] = {
    "format", "version", "unit", "ranks", "chunks", "placement", "time_f", "time_b", "time_w",
    "time_bw", "time_comm", "w_share", "mem_f_bytes", "time_offload", "time_reload"};

/* Where each per-stage array of the format goes; NULL for the other keys. */
static double **array_of(zb__costs_t *c, int key) {
  switch (key) {
    case K_TIME_F: return &c->time_f;
    case K_TIME_B: return &c->time_b;
    case K_TIME_W: return &c->time_w;
    case K_TIME_BW: return &c->time_bw;
    case K_MEM_F_BYTES: return &c->mem_f_bytes;
    case K_TIME_OFFLOAD: return &c->time_offload;
    case K_TIME_RELOAD: return &c->time_reload;
    default: return NULL;
  }
}

/* Reads a string value of a known key; *fits is 0 when it was too long for buf (and so cannot
 * equal any value this format knows). */
static int read_name(reader_t *r, const char *key, char *buf, size_t cap, int *fits) {
  size_t at = (skip_ws(r), r->i), len;
  if (!peek(r, '"')) return fail_at(r, at, "\"%s\" must be a string, got %s", key, describe(r));
  if (!read_string(r, buf, cap, &len)) return 0;
  *fits = len < cap;
  return 1;
}

/* Reads the value of a known key into c; lengths[key] gets an array's length. */
static int read_key(reader_t *r, int key, zb__costs_t *c, int *lengths) {
  const char *name = KEYS[key];
  size_t at = (skip_ws(r), r->i);
  double **array = array_of(c, key);
  /* null is the same as a missing key, except for the three arrays every file must give. */
  if (key != K_TIME_F && key != K_TIME_B && key != K_TIME_W && read_null(r)) return 1;
  if (array) return read_array(r, name, array, &lengths[key]);
  char str[64];
  int fits = 0;
  const char *more;
  double x;
  switch (key) {
    case K_FORMAT:
    case K_UNIT:
    case K_PLACEMENT:
      if (!read_name(r, name, str, sizeof str, &fits)) return 0;
      more = fits ? "" : "...";
      if (key == K_FORMAT && (!fits || strcmp(str, "zbpp-costs") != 0))
        return fail_at(r, at, "\"format\" is \"%s%s\"; a cost file says \"zbpp-costs\"", str,
                       more);
      if (key == K_UNIT && (!fits || strcmp(str, "ms") != 0))
        return fail_at(r, at, "\"unit\" is \"%s%s\"; version 1 cost files give times in \"ms\"",
                       str, more);
      if (key == K_PLACEMENT) {
        c->placement = !fits ? -1 : !strcmp(str, "loop") ? 0 : !strcmp(str, "v") ? 1 : -1;
        if (c->placement < 0)
          return fail_at(r, at, "\"placement\" is \"%s%s\"; it is \"loop\" or \"v\"", str, more);
      }
      return 1;
    case K_VERSION:
      if (!read_scalar(r, name, &x)) return 0;
      if (x != 1) return fail_at(r, at, "\"version\" is %g; this zbpp reads version 1 cost files", x);
      return 1;
    case K_RANKS: return read_count(r, name, &c->ranks);
    case K_CHUNKS: return read_count(r, name, &c->chunks);
    case K_TIME_COMM:
      if (!read_scalar(r, name, &x)) return 0;
      if (!isfinite(x) || x < 0)
        return fail_at(r, at, "\"time_comm\" is %g; times must be finite and >= 0", x);
      c->time_comm = x, c->has_time_comm = 1;
      return 1;
    case K_W_SHARE:
      if (!read_scalar(r, name, &x)) return 0;
      if (!(x >= 0 && x <= 1))
        return fail_at(r, at, "\"w_share\" is %g; it is the share of activations only W needs, "
                              "in [0, 1]", x);
      c->w_share = x, c->has_w_share = 1;
      return 1;
    default: return fail_at(r, at, "internal: no reader for \"%s\"", name);
  }
}

void zb__costs_free(zb__costs_t *c) {
  free(c->time_f);
  free(c->time_b);
  free(c->time_w);
  free(c->time_bw);
  free(c->mem_f_bytes);
  free(c->time_offload);
  free(c->time_reload);
  memset(c, 0, sizeof *c);
  c->placement = -1;
}

static int parse_object(reader_t *r, zb__costs_t *c, int *lengths) {
  if (!expect(r, '{', "at the start of a cost file (one JSON object)")) return 0;
  if (peek(r, '}')) return r->i++, 1;
  unsigned seen = 0;
  for (;;) {
    size_t at = (skip_ws(r), r->i);
    char key[32];
    size_t len;
    if (!peek(r, '"'))
      return fail_at(r, at, "expected a key (a string) in the object, got %s", describe(r));
    if (!read_string(r, key, sizeof key, &len)) return 0;
    if (!expect(r, ':', "after a key")) return 0;
    int k = 0;
    while (k < K_COUNT && (len >= sizeof key || strcmp(key, KEYS[k]) != 0)) k++;
    if (k < K_COUNT) {
      if (seen & (1u << k)) return fail_at(r, at, "\"%s\" appears twice", KEYS[k]);
      seen |= 1u << k;
      if (!read_key(r, k, c, lengths)) return 0;
    } else if (!skip_value(r, 1)) { /* a key from a newer version: ignored */
      return 0;
    }
    if (peek(r, ',')) {
      r->i++;
      if (peek(r, '}')) return fail_at(r, r->i, "'}' after ',': JSON allows no trailing comma");
      continue;
    }
    if (peek(r, '}')) return r->i++, 1;
    return fail_at(r, r->i, "expected ',' or '}' after a value in an object, got %s", describe(r));
  }
}

/* The rules between keys, once the whole object is read. */
static int check_file(const char *name, const zb__costs_t *c, const int *lengths, char *err,
                      size_t err_len) {
  const double *required[3] = {c->time_f, c->time_b, c->time_w};
  for (int k = 0; k < 3; k++)
    if (!required[k]) {
      message(err, err_len,
              "%s: \"%s\" is missing; a cost file needs time_f, time_b and time_w, one value per "
              "stage",
              name, KEYS[K_TIME_F + k]);
      return 0;
    }
  const int arrays[] = {K_TIME_B, K_TIME_W, K_TIME_BW, K_MEM_F_BYTES, K_TIME_OFFLOAD, K_TIME_RELOAD};
  for (size_t k = 0; k < sizeof arrays / sizeof arrays[0]; k++) {
    int n = lengths[arrays[k]];
    if (n && n != c->stages) {
      message(err, err_len,
              "%s: \"%s\" has %d values but \"time_f\" has %d; every per-stage array has one "
              "value per stage",
              name, KEYS[arrays[k]], n, c->stages);
      return 0;
    }
  }
  if (!c->time_offload != !c->time_reload) {
    message(err, err_len, "%s: \"time_offload\" and \"time_reload\" go together (the copy to host memory and back)",
            name);
    return 0;
  }
  if (c->ranks && c->chunks && (long long)c->ranks * c->chunks != c->stages) {
    message(err, err_len,
            "%s: \"ranks\": %d times \"chunks\": %d is %lld stages, but the per-stage arrays "
            "have %d values",
            name, c->ranks, c->chunks, (long long)c->ranks * c->chunks, c->stages);
    return 0;
  }
  return 1;
}

int zb__costs_parse(const char *text, size_t len, const char *name, zb__costs_t *out, char *err,
                    size_t err_len) {
  memset(out, 0, sizeof *out);
  out->placement = -1;
  reader_t r = {name, text, len, 0, err, err_len};
  int lengths[K_COUNT] = {0};
  int ok = parse_object(&r, out, lengths);
  if (ok) {
    skip_ws(&r);
    if (r.i < r.n)
      ok = fail_at(&r, r.i, "unexpected text after the object (a cost file is one JSON object)");
  }
  out->stages = lengths[K_TIME_F];
  if (ok) ok = check_file(name, out, lengths, err, err_len);
  if (!ok) zb__costs_free(out);
  return ok;
}

int zb__costs_check_shape(const zb__costs_t *c, const char *name, int p, int v, int placement,
                          const char *source, char *err, size_t err_len) {
  if (c->ranks && c->ranks != p) {
    message(err, err_len, "%s says \"ranks\": %d, but %s p = %d ranks", name, c->ranks, source, p);
    return 0;
  }
  if (c->chunks && c->chunks != v) {
    message(err, err_len, "%s says \"chunks\": %d, but %s v = %d (chunks per rank)", name,
            c->chunks, source, v);
    return 0;
  }
  if ((long long)p * v != c->stages) {
    char hint[80] = "";
    if (p > 0 && c->stages % p == 0 && !c->chunks)
      snprintf(hint, sizeof hint, " (%d stages over p = %d ranks is v = %d)", c->stages, p, c->stages / p);
    message(err, err_len,
            "%s has %d stages (values in time_f), but %s p * v = %d * %d = %lld stages%s", name,
            c->stages, source, p, v, (long long)p * v, hint);
    return 0;
  }
  static const char *const names[2] = {"loop", "v"};
  if (c->placement >= 0 && placement >= 0 && c->placement != placement) {
    message(err, err_len, "%s says \"placement\": \"%s\", but %s the \"%s\" placement", name,
            names[c->placement], source, names[placement]);
    return 0;
  }
  return 1;
}
