/*
 * tool.h - what the zbpp tool's subcommands share: argument parsing and error exits.
 * Exit codes: 0 success, 1 a failure the library reported, 2 a usage error.
 */
#ifndef ZB_TOOL_H
#define ZB_TOOL_H

#include <stddef.h>

/* Prints "zbpp: <fmt with what>" and the --help hint on stderr; returns 2. */
int zb__tool_bad_usage(const char *fmt, const char *what);
/* Prints "zbpp: OPTION wants WANT, got 'VALUE'" and the --help hint on stderr; returns 2. */
int zb__tool_bad_value(const char *option, const char *want, const char *value);
/* Prints "zbpp: <what>: <zb_last_error()>" (without source positions) on stderr; returns 1. */
int zb__tool_fail(const char *what);
/* A library message without its C source positions ("schedule.c:102: ", for developers), in a
 * buffer of the tool's that the next call reuses; zb__tool_error() is zb_last_error() so cleaned.
 * Every message of the library the tool prints goes through one of them (output.c). */
const char *zb__tool_plain(const char *msg);
const char *zb__tool_error(void);
/* Writes len bytes to path whole or not at all (a temporary file renamed over it; output.c says
 * why). Returns 0, or prints what failed and that path was left unchanged, and returns 1. */
int zb__tool_write_file(const char *path, const char *data, size_t len);
/* Whole-string number parsing; 1 on success. */
int zb__tool_parse_int(const char *s, int *out);
int zb__tool_parse_double(const char *s, double *out);

/* Limits OpenBLAS (when that is the BLAS) to one thread per call: ranks are the threads here. */
void zb__tool_one_blas_thread(void);

#if defined(__GNUC__)
#define ZB__TOOL_PRINTF(f, a) __attribute__((format(printf, f, a)))
#else
#define ZB__TOOL_PRINTF(f, a)
#endif

/* A per-stage cost file ("zbpp-costs", version 1; costs.c and docs/tool.md describe the format).
 * Arrays hold `stages` values each, absolute per stage (zb_schedule_spec_t.stage_time_* units). */
typedef struct {
  int stages;                       /* S: the length of every per-stage array */
  double *time_f, *time_b, *time_w; /* always present after a successful parse */
  double *time_bw;                  /* NULL when the file leaves it out: B + W */
  double *mem_f_bytes;              /* NULL when left out; checked, not used by the tool */
  double *time_offload, *time_reload; /* PipeOffload's copy times, both or neither; NULL when left out */
  int ranks, chunks;                /* 0 when the file does not say */
  int placement;                    /* a zb_placement_t, or -1 when the file does not say */
  int has_time_comm, has_w_share;   /* whether time_comm / w_share were given */
  double time_comm, w_share;
} zb__costs_t;

/* Parses a cost file's text (len bytes, no NUL needed); `name` is used in messages. Returns 1, or
 * 0 with a message in err ("NAME:LINE:COLUMN: ..." for malformed JSON, "NAME: ..." for a rule
 * broken) and *out empty. Free a parsed file with zb__costs_free. */
int zb__costs_parse(const char *text, size_t len, const char *name, zb__costs_t *out, char *err,
                    size_t err_len);
void zb__costs_free(zb__costs_t *c);
/* Checks the file's optional ranks/chunks/placement and its stage count against the schedule's p,
 * v and placement (-1: not known yet, not checked). `source` completes "but SOURCE p = 4 ranks",
 * e.g. "the command asks for". Returns 1, or 0 with a message in err. */
int zb__costs_check_shape(const zb__costs_t *c, const char *name, int p, int v, int placement,
                          const char *source, char *err, size_t err_len);

int zb__tool_verify(int argc, char **argv);
int zb__tool_bench(int argc, char **argv);

#endif
