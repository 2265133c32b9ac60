/*
 * tool.h - what the zbpp tool's subcommands share: argument parsing and error exits.
 * Exit codes: 0 success, 1 a failure the library reported, 2 a usage error.
 */
#ifndef ZB_TOOL_H
#define ZB_TOOL_H

/* Prints "zbpp: <fmt with what>" and the --help hint on stderr; returns 2. */
int zb__tool_bad_usage(const char *fmt, const char *what);
/* Prints "zbpp: <what>: <zb_last_error()>" on stderr; returns 1. */
int zb__tool_fail(const char *what);
/* Whole-string number parsing; 1 on success. */
int zb__tool_parse_int(const char *s, int *out);
int zb__tool_parse_double(const char *s, double *out);

/* Limits OpenBLAS (when that is the BLAS) to one thread per call: ranks are the threads here. */
void zb__tool_one_blas_thread(void);

int zb__tool_verify(int argc, char **argv);
int zb__tool_bench(int argc, char **argv);

#endif
