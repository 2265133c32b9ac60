/*
 * main.c - the `zbpp` command-line tool: generate, validate, simulate and draw schedules.
 *
 *   zbpp schedule KIND -p P -m M [-v V] [cost options] [--format F] [-o FILE]
 *   zbpp simulate FILE.csv [cost options] [--format F] [-o FILE]
 *   (cost options: --times F,B,W[,BW] or --stage-times FILE (costs.c), --comm, --w-share, --mem-limit)
 *
 *   zbpp verify KIND -p P -m M [...]   (verify.c)
 *   zbpp bench [...]                   (bench.c)
 *
 * What this is not: part of the library. schedule and simulate only call the public API in zbpp.h,
 * so everything they do, a C or Python caller can do too; verify and bench also drive the library's
 * internal reference model and trainer (linked statically), which are not part of the ABI. Exit
 * codes: 0 success, 1 a failure the library reported (invalid schedule, infeasible limit, unreadable
 * file, parameters not bit-for-bit equal) or a cost file that is malformed or does not fit the
 * command, or an output that could not be written (FILE is then left as it was: output.c), 2 a
 * usage error. Library messages are printed without their C source positions.
 */
#define _GNU_SOURCE /* RTLD_DEFAULT */
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tool.h"
#include "zbpp.h"

/* The kinds, one line each (zbpp --help and zbpp schedule --help). */
static void kinds(FILE *out) {
  fprintf(out, "Kinds:\n");
  for (int k = 0; k < ZB_KIND_COUNT; k++) {
    if (k == ZB_KIND_CUSTOM) continue;
    fprintf(out, "  %-17s %s\n", zb_kind_name((zb_kind_t)k), zb_kind_help((zb_kind_t)k));
  }
  fprintf(out,
          "  (aliases: zb-1p and zb-2p are zb-auto at limit p and 2p, gis is group-interleaved-1f1b;\n"
          "   torch's names 1F1B, Interleaved1F1B, GPipe, ZBVZeroBubble and InterleavedZeroBubble work too)\n");
}

/* zbpp --help: the commands, the kinds, where each command's options are. */
static void usage(FILE *out) {
  fprintf(out,
          "zbpp %s - zero-bubble pipeline-parallel schedules\n"
          "\n"
          "Usage:\n"
          "  zbpp schedule KIND -p P -m M [-v V] [options]   generate, validate and print a schedule\n"
          "  zbpp simulate FILE.csv [options]                validate and simulate a schedule file\n"
          "  zbpp verify KIND -p P -m M [options]            train the reference model with the schedule\n"
          "                                                  and sequentially; compare bit for bit\n"
          "  zbpp bench [options]                            every schedule on real threads: it/s, bubble\n"
          "  zbpp COMMAND --help                             the command's options\n"
          "  zbpp --help | --version\n"
          "\n",
          zb_version());
  kinds(out);
  fprintf(out,
          "\n"
          "Examples:\n"
          "  zbpp schedule zb-v -p 4 -m 8\n"
          "  zbpp schedule zb-v -p 4 -m 8 --format svg -o zbv.svg\n"
          "  zbpp schedule zb-auto -p 8 -m 24 --times 18.5,18.1,9.3 --comm 0.6 --mem-limit 2p\n");
}

/* zbpp schedule --help and zbpp simulate --help: the options they share (simulate takes p, v, m
 * and the placement from its file). */
static void schedule_usage(FILE *out, int simulate) {
  if (simulate)
    fprintf(out,
            "Usage: zbpp simulate FILE.csv [options]\n"
            "\n"
            "Validates and simulates a schedule file (zbpp schedule --format csv writes one; the ranks,\n"
            "chunks, microbatches and placement come from it) and prints it as zbpp schedule does.\n"
            "\n");
  else {
    fprintf(out,
            "Usage: zbpp schedule KIND -p P -m M [-v V] [options]\n"
            "\n"
            "Generates a schedule, validates and simulates it, and prints it (a text grid by default).\n"
            "\n");
    kinds(out);
    fprintf(out, "\n");
  }
  fprintf(out, "Options:\n");
  if (!simulate)
    fprintf(out,
            "  -p, --ranks P        pipeline ranks (>= 1)\n"
            "  -m, --microbatches M microbatches per iteration (>= 1; some kinds need more)\n"
            "  -v, --chunks V       model chunks per rank (default: 2 for V kinds and interleaved, else 1)\n");
  fprintf(out,
          "  --times F,B,W[,BW]   time of one microbatch through all of a rank's layers for the\n"
          "                       forward, input backward, weight backward (and fused backward;\n"
          "                       default B+W); each op of a v-chunk schedule takes 1/v. Default 1,1,1\n"
          "  --stage-times FILE   per-stage costs from a JSON cost file (\"format\": \"zbpp-costs\"):\n"
          "                       time_f, time_b, time_w[, time_bw] hold one absolute time per stage\n"
          "                       (S = p*v values, not divided by v); instead of --times. The file's\n"
          "                       time_comm and w_share apply unless --comm / --w-share are given\n"
          "  --comm C             time added to every dependency that crosses ranks (default 0)\n"
          "  --w-share W          share of activations only W needs, in [0,1] (default 0.5)\n"
          "  --copy-times O,R     time to copy one microbatch's activations through all of a rank's\n"
          "                       layers to host memory and back (PipeOffload; default 0,0)\n"
          "  --offload            place copies into the schedule (offload pass): longest-lived\n"
          "                       activations first, only where the step does not grow; prints\n"
          "                       each rank's device and host peak. zb-auto plans its order and\n"
          "                       the copies together under --mem-limit (orders for more memory,\n"
          "                       brought down to it by copies, where that steps shorter)\n"
          "  --offload-limit L    stop offloading once every rank's device peak is at most L\n"
          "  --offload-slowdown X let the step grow by the fraction X for more offload (default 0)\n"
          "  --offload-paired     ranks 2k and 2k+1 share one link to host memory (one PCIe switch):\n"
          "                       their copies take turns\n");
  if (!simulate)
    fprintf(out,
            "  --vocab N            Vocabulary Parallelism's passes on every rank: 2 for one\n"
            "                       all-reduce barrier a microbatch (the reference's Vocab-2), 1 for two\n"
            "  --vocab-times S,T,I,E,C  one rank's pass times: S (output layer forward), T (its\n"
            "                       backward), I and E (the embedding's), C (a barrier's all-reduces)\n");
  fprintf(out,
          "  --mem-limit L        peak activation memory per rank in microbatches, or 'Np' for N*p\n"
          "                       (zb-auto's target; a limit for validation otherwise)\n");
  if (!simulate)
    fprintf(out,
            "  --placement P        loop or v: where zb-auto puts the stages (default: v for v = 2, else\n"
            "                       loop; loop with any v is torch's interleaved placement). With\n"
            "                       --stage-times, zb-auto takes the file's placement unless this is given\n");
  fprintf(out,
          "  --format F           text (default), csv, json, chrome, svg, or csv-comms (torch's\n"
          "                       compute_comms CSV: the transfers added, for torch's runtime)\n"
          "  -o, --output FILE    write there instead of standard output: the whole file or, if\n"
          "                       writing fails, FILE left as it was\n"
          "  -h, --help           this text\n"
          "\n"
          "Examples:\n");
  if (simulate)
    fprintf(out,
            "  zbpp schedule 1f1b -p 4 -m 8 --format csv -o 1f1b.csv && zbpp simulate 1f1b.csv\n"
            "  zbpp simulate 1f1b.csv --times 1,2,1 --comm 0.1 --format svg -o 1f1b.svg\n");
  else
    fprintf(out,
            "  zbpp schedule zb-v -p 4 -m 8\n"
            "  zbpp schedule zb-auto -p 8 -m 24 --times 18.5,18.1,9.3 --comm 0.6 --mem-limit 2p\n"
            "  zbpp schedule 1f1b -p 4 -m 8 --copy-times 0.25,0.25 --offload\n"
            "  zbpp schedule 1f1b -p 4 -m 8 --vocab 2 --vocab-times 0.5,0.5,0.1,0.1,0.05\n"
            "  zbpp schedule zb-auto -p 4 -m 16 -v 2 --stage-times costs.json --format svg -o zbv.svg\n");
}

typedef struct {
  const char *command, *kind, *file, *format, *output, *mem_limit, *stage_times;
  int p, m, v;
  int placement; /* -1: not given; else a zb_placement_t */
  double times[4];
  int n_times;
  double copy_times[2]; /* --copy-times: OFFLOAD, RELOAD */
  int offload;          /* --offload or --offload-limit: run the offload pass */
  int has_copy_times;
  int vocab;             /* --vocab: 0, 1 or 2 */
  double vocab_times[5]; /* --vocab-times: S, T, IF, IB, barrier */
  double offload_limit, offload_slowdown;
  int offload_paired; /* --offload-paired: ranks 2k and 2k+1 share one link */
  double comm, w_share;
  int has_comm, has_w_share; /* given on the command line: they win over a cost file's values */
} args_t;

/* The command being run (argv[1] when it is one), for "Run 'zbpp schedule --help'". */
static const char *tool_command = NULL;

static void see_help(void) {
  if (tool_command) fprintf(stderr, "Run 'zbpp %s --help' for its options.\n", tool_command);
  else fprintf(stderr, "Run 'zbpp --help' for usage.\n");
}

int zb__tool_bad_usage(const char *fmt, const char *what) {
  fprintf(stderr, "zbpp: ");
  fprintf(stderr, fmt, what);
  fprintf(stderr, "\n");
  see_help();
  return 2;
}

int zb__tool_bad_value(const char *option, const char *want, const char *value) {
  fprintf(stderr, "zbpp: %s wants %s, got '%s'\n", option, want, value);
  see_help();
  return 2;
}

int zb__tool_parse_int(const char *s, int *out) {
  char *end;
  errno = 0;
  long x = strtol(s, &end, 10);
  if (errno || end == s || *end || x < -2147483647L || x > 2147483647L) return 0;
  *out = (int)x;
  return 1;
}

int zb__tool_parse_double(const char *s, double *out) {
  char *end;
  errno = 0;
  double x = strtod(s, &end);
  if (errno || end == s || *end) return 0;
  *out = x;
  return 1;
}

/* Parses up to 4 comma-separated numbers into t; *n gets how many. */
static int parse_numbers(const char *s, double *t, int *n, int max) {
  char buf[256];
  if (strlen(s) >= sizeof buf) return 0;
  strcpy(buf, s);
  *n = 0;
  char *save = NULL;
  for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    if (*n == max || !zb__tool_parse_double(tok, &t[*n])) return 0;
    (*n)++;
  }
  return 1;
}

/* Parses "F,B,W" or "F,B,W,BW". */
static int parse_times(const char *s, double *t, int *n) { return parse_numbers(s, t, n, 4) && (*n == 3 || *n == 4); }

static int parse_args(int argc, char **argv, args_t *a) {
  memset(a, 0, sizeof *a);
  a->p = a->m = INT_MIN; /* "not given": any number the user gives goes to the library to judge */
  a->placement = -1;
  a->times[0] = a->times[1] = a->times[2] = 1.0;
  a->w_share = 0.5;
  a->command = argv[1];
  int positional = 0;
  for (int i = 2; i < argc; i++) {
    const char *arg = argv[i];
    const char *val = i + 1 < argc ? argv[i + 1] : NULL;
#define NEED_VALUE()                                                                               \
  do {                                                                                             \
    if (!val) return zb__tool_bad_usage("option %s needs a value", arg);                       \
    i++;                                                                                           \
  } while (0)
    if (!strcmp(arg, "-p") || !strcmp(arg, "--ranks")) {
      NEED_VALUE();
      if (!zb__tool_parse_int(val, &a->p)) return zb__tool_bad_usage("-p wants a whole number, got '%s'", val);
    } else if (!strcmp(arg, "-m") || !strcmp(arg, "--microbatches")) {
      NEED_VALUE();
      if (!zb__tool_parse_int(val, &a->m)) return zb__tool_bad_usage("-m wants a whole number, got '%s'", val);
    } else if (!strcmp(arg, "-v") || !strcmp(arg, "--chunks")) {
      NEED_VALUE();
      /* 0 is the library's "the kind's default"; given by a user it is a mistake, not a request. */
      if (!zb__tool_parse_int(val, &a->v) || a->v < 1)
        return zb__tool_bad_value(arg, "a whole number >= 1 (model chunks per rank; leave it out for the kind's default)", val);
    } else if (!strcmp(arg, "--times")) {
      NEED_VALUE();
      if (!parse_times(val, a->times, &a->n_times))
        return zb__tool_bad_usage("--times wants F,B,W or F,B,W,BW (numbers), got '%s'", val);
      /* The library reads time_bw <= 0 as "B + W": a BW the user wrote must not turn into that. */
      if (a->n_times == 4 && !(a->times[3] > 0))
        return zb__tool_bad_value("--times", "a fused backward time BW > 0 as its fourth value (leave it out for B + W)", val);
    } else if (!strcmp(arg, "--copy-times")) {
      NEED_VALUE();
      double t[4];
      int n = 0;
      if (!parse_numbers(val, t, &n, 4) || n != 2 || !(t[0] >= 0) || !(t[1] >= 0))
        return zb__tool_bad_value("--copy-times", "OFFLOAD,RELOAD: two times >= 0 (per rank, like --times)", val);
      a->copy_times[0] = t[0], a->copy_times[1] = t[1];
      a->has_copy_times = 1;
    } else if (!strcmp(arg, "--vocab")) {
      NEED_VALUE();
      if (strcmp(val, "1") && strcmp(val, "2"))
        return zb__tool_bad_value("--vocab", "1 (two all-reduce barriers a microbatch, Vocab-1) or 2 (one, the backward "
                                             "fused into S, Vocab-2)", val);
      a->vocab = val[0] - '0';
    } else if (!strcmp(arg, "--vocab-times")) {
      NEED_VALUE();
      double t[8];
      int n = 0;
      if (!parse_numbers(val, t, &n, 8) || n != 5 || !(t[0] >= 0 && t[1] >= 0 && t[2] >= 0 && t[3] >= 0 && t[4] >= 0))
        return zb__tool_bad_value("--vocab-times", "S,T,IF,IB,C: five times >= 0 (one rank's passes and a barrier)", val);
      for (int k = 0; k < 5; k++) a->vocab_times[k] = t[k];
    } else if (!strcmp(arg, "--offload")) {
      a->offload = 1;
    } else if (!strcmp(arg, "--offload-paired")) {
      a->offload = 1, a->offload_paired = 1;
    } else if (!strcmp(arg, "--offload-limit")) {
      NEED_VALUE();
      if (!zb__tool_parse_double(val, &a->offload_limit) || !(a->offload_limit > 0) || isinf(a->offload_limit))
        return zb__tool_bad_value("--offload-limit", "a number of microbatches > 0 (the device peak to reach)", val);
      a->offload = 1;
    } else if (!strcmp(arg, "--offload-slowdown")) {
      NEED_VALUE();
      if (!zb__tool_parse_double(val, &a->offload_slowdown) || !(a->offload_slowdown >= 0) ||
          isinf(a->offload_slowdown))
        return zb__tool_bad_value("--offload-slowdown", "a fraction >= 0 the step may grow by (0.05 for 5%)", val);
      a->offload = 1;
    } else if (!strcmp(arg, "--comm")) {
      NEED_VALUE();
      if (!zb__tool_parse_double(val, &a->comm)) return zb__tool_bad_usage("--comm wants a number, got '%s'", val);
      a->has_comm = 1;
    } else if (!strcmp(arg, "--w-share")) {
      NEED_VALUE();
      if (!zb__tool_parse_double(val, &a->w_share))
        return zb__tool_bad_usage("--w-share wants a number in [0,1], got '%s'", val);
      a->has_w_share = 1;
    } else if (!strcmp(arg, "--stage-times")) {
      NEED_VALUE();
      a->stage_times = val;
    } else if (!strcmp(arg, "--mem-limit")) {
      NEED_VALUE();
      a->mem_limit = val;
    } else if (!strcmp(arg, "--placement")) {
      NEED_VALUE();
      if (!strcmp(val, "loop")) a->placement = ZB_PLACEMENT_LOOP;
      else if (!strcmp(val, "v")) a->placement = ZB_PLACEMENT_V;
      else return zb__tool_bad_usage("--placement is loop or v, got '%s'", val);
    } else if (!strcmp(arg, "--format")) {
      NEED_VALUE();
      a->format = val;
    } else if (!strcmp(arg, "-o") || !strcmp(arg, "--output")) {
      NEED_VALUE();
      a->output = val;
    } else if (arg[0] == '-' && arg[1] != '\0') {
      return zb__tool_bad_usage("unknown option '%s'", arg);
    } else if (positional++ == 0) {
      if (!strcmp(a->command, "schedule")) a->kind = arg;
      else a->file = arg;
    } else {
      return zb__tool_bad_usage("unexpected argument '%s'", arg);
    }
#undef NEED_VALUE
  }
  if (a->stage_times && a->n_times)
    return zb__tool_bad_usage("%s", "--times and --stage-times both give the costs; drop --times to use the "
                                    "cost file's per-stage times, or drop --stage-times");
  return 0;
}

/* Fills the cost part of a spec from the options and, when given, a cost file (whose arrays the
 * spec then points at); p is needed for an 'Np' memory limit. */
static int fill_costs(const args_t *a, const zb__costs_t *costs, zb_schedule_spec_t *spec, int p) {
  spec->time_f = a->times[0];
  spec->time_b = a->times[1];
  spec->time_w = a->times[2];
  spec->time_bw = a->n_times == 4 ? a->times[3] : 0.0;
  spec->time_comm = a->comm;
  spec->w_share = a->w_share;
  spec->time_offload = a->copy_times[0];
  spec->time_reload = a->copy_times[1];
  spec->vocab = a->vocab;
  spec->time_s = a->vocab_times[0], spec->time_t = a->vocab_times[1];
  spec->time_if = a->vocab_times[2], spec->time_ib = a->vocab_times[3];
  spec->time_vocab_comm = a->vocab_times[4];
  if (costs) {
    spec->stage_time_f = costs->time_f;
    spec->stage_time_b = costs->time_b;
    spec->stage_time_w = costs->time_w;
    spec->stage_time_bw = costs->time_bw; /* NULL: B + W per stage */
    spec->stage_time_offload = costs->time_offload; /* NULL: --copy-times */
    spec->stage_time_reload = costs->time_reload;
    if (costs->has_time_comm && !a->has_comm) spec->time_comm = costs->time_comm;
    if (costs->has_w_share && !a->has_w_share) spec->w_share = costs->w_share;
  }
  if (a->mem_limit) {
    const char *s = a->mem_limit;
    size_t n = strlen(s);
    double x;
    if (n > 1 && (s[n - 1] == 'p' || s[n - 1] == 'P')) {
      char buf[64];
      if (n >= sizeof buf) return zb__tool_bad_usage("--mem-limit '%s' is too long", s);
      memcpy(buf, s, n - 1);
      buf[n - 1] = '\0';
      if (!zb__tool_parse_double(buf, &x)) return zb__tool_bad_usage("--mem-limit wants a number or Np, got '%s'", s);
      x *= p;
    } else if (!zb__tool_parse_double(s, &x)) {
      return zb__tool_bad_usage("--mem-limit wants a number or Np, got '%s'", s);
    }
    if (!(x > 0) || isinf(x))
      return zb__tool_bad_usage("--mem-limit must be a positive number of microbatches, got '%s'", s);
    spec->mem_limit = x;
  }
  return 0;
}

void zb__tool_one_blas_thread(void) {
  /* Ranks are threads here, each standing for one device: an OpenBLAS that also splits every GEMM
   * over all cores would oversubscribe them and blur the timings. Other BLAS builds have no such
   * switch and are left alone. */
  void (*set_threads)(int) = (void (*)(int))dlsym(RTLD_DEFAULT, "openblas_set_num_threads");
  if (set_threads) set_threads(1);
}

int zb__tool_fail(const char *what) {
  fprintf(stderr, "zbpp: %s: %s\n", what, zb__tool_error());
  return 1;
}

static char *read_file(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  size_t cap = 1 << 16, n = 0;
  char *buf = malloc(cap);
  while (buf) {
    size_t got = fread(buf + n, 1, cap - n, f);
    n += got;
    if (n < cap) break;
    char *grown = cap < ((size_t)1 << 30) ? realloc(buf, cap * 2) : NULL;
    if (!grown) {
      free(buf);
      buf = NULL;
      break;
    }
    buf = grown;
    cap *= 2;
  }
  int err = ferror(f);
  fclose(f);
  if (err) {
    free(buf);
    return NULL;
  }
  *len = n;
  return buf;
}

/* Validates, simulates, prints the chosen format and a summary line on stderr. */
static int emit(zb_schedule_t *s, const args_t *a) {
  zb_format_t fmt = ZB_FORMAT_TEXT;
  if (a->format && zb_format_from_name(a->format, &fmt) != ZB_OK)
    return zb__tool_bad_usage("%s", zb__tool_error());
  if (zb_schedule_validate(s) != ZB_OK) return zb__tool_fail("the schedule is not valid");
  zb_sim_result_t r;
  if (zb_schedule_simulate(s, &r) != ZB_OK) return zb__tool_fail("simulation failed");
  char *text = NULL;
  size_t len = 0;
  if (zb_schedule_export(s, fmt, &text, &len) != ZB_OK) return zb__tool_fail("export failed");
  if (a->output) {
    int rc = zb__tool_write_file(a->output, text, len);
    zb_free(text);
    if (rc) return rc;
  } else {
    errno = 0;
    int ok = fwrite(text, 1, len, stdout) == len;
    ok = (fflush(stdout) == 0) && ok;
    zb_free(text);
    if (!ok) {
      if (errno == EPIPE) return 0; /* the reader closed the pipe: see main() */
      fprintf(stderr, "zbpp: writing standard output failed: %s\n",
              errno ? strerror(errno) : "short write");
      return 1;
    }
  }
  if (a->output) {
    zb_schedule_info_t info;
    zb_schedule_get_info(s, &info);
    double idle = 0;
    zb_schedule_step_idle(s, NULL, &idle);
    fprintf(stderr, "zbpp: wrote %s (%s, p=%d v=%d m=%d: cost %.6g, bubble %.2f%%, idle %.2f%%, peak memory %.4g)\n",
            a->output, zb_kind_name(info.kind), info.ranks, info.chunks, info.microbatches, r.cost,
            100 * r.bubble_rate, 100 * idle, r.max_peak_memory);
  }
  return 0;
}

/* With --offload: *s replaced by the offload pass's result (zb_schedule_plan_offload), or, for
 * zb-auto, and v-min/v-half under --offload-limit (spec given), by order and copies planned
 * together (zb_schedule_create_offloaded). */
static int apply_offload(const args_t *a, zb_schedule_t **s, const zb_schedule_spec_t *spec) {
  if (!a->offload) return 0;
  double t = 0;
  if (!a->has_copy_times && zb_schedule_op_time(*s, ZB_OP_RELOAD, 0, &t) == ZB_OK && t <= 0)
    return zb__tool_bad_usage("%s", "--offload needs --copy-times O,R (the time to copy one microbatch's activations "
                                    "through all of a rank's layers to host memory and back, in --times' units), or "
                                    "--stage-times with time_offload and time_reload");
  zb_offload_config_t cfg = ZB_OFFLOAD_CONFIG_INIT;
  cfg.device_limit = a->offload_limit, cfg.slowdown = a->offload_slowdown;
  cfg.paired_lanes = a->offload_paired;
  zb_schedule_t *off = NULL;
  if (spec && (spec->kind == ZB_KIND_ZB_AUTO ||
               ((spec->kind == ZB_KIND_V_MIN || spec->kind == ZB_KIND_V_HALF) && cfg.device_limit > 0))) {
    if (zb_schedule_create_offloaded(&off, spec, &cfg) != ZB_OK)
      return zb__tool_fail(spec->kind == ZB_KIND_ZB_AUTO ? "cannot plan zb-auto with offload"
                                                         : "cannot plan the V kind with offload");
  } else if (zb_schedule_plan_offload(&off, *s, &cfg) != ZB_OK) {
    return zb__tool_fail("cannot plan offload");
  }
  zb_schedule_info_t got;
  if (spec && zb_schedule_get_info(off, &got) == ZB_OK && got.kind != spec->kind)
    fprintf(stderr, "zbpp: offload: %s's order with copies holds %s to --offload-limit %g and steps shorter than %s's own\n",
            zb_kind_name(got.kind), zb_kind_name(spec->kind), a->offload_limit, zb_kind_name(spec->kind));
  zb_schedule_destroy(*s);
  *s = off;
  return 0;
}

/* After --offload: each rank's device and host peak on stderr (the plan is on stdout). */
static int offload_summary(zb_schedule_t *s, const args_t *a) {
  zb_schedule_info_t info;
  if (zb_schedule_get_info(s, &info) != ZB_OK) return zb__tool_fail("offload summary");
  int copies = 0;
  for (int r = 0; r < info.ranks; r++) {
    const zb_op_t *ops;
    int32_t n = 0;
    zb_schedule_rank_ops(s, r, &ops, &n);
    for (int k = 0; k < n; k++) copies += ops[k].type == ZB_OP_OFFLOAD;
  }
  fprintf(stderr, "zbpp: offload: %d microbatch(es) moved to host memory; per rank, device peak / host peak:", copies);
  for (int r = 0; r < info.ranks; r++) {
    double dev = 0, host = 0;
    zb_schedule_rank_memory(s, r, &dev, &host);
    fprintf(stderr, " %d: %.4g / %.4g%s", r, dev, host, r + 1 < info.ranks ? "," : "\n");
  }
  double worst = 0;
  for (int r = 0; r < info.ranks; r++) {
    double dev = 0;
    zb_schedule_rank_memory(s, r, &dev, NULL);
    if (dev > worst) worst = dev;
  }
  if (copies == 0 && a->offload_limit > 0 && worst <= a->offload_limit)
    fprintf(stderr, "zbpp: offload: every rank is within --offload-limit %g already; nothing to move\n",
            a->offload_limit);
  else if (copies == 0)
    fprintf(stderr, "zbpp: offload: no copy fits: none both hides (a round trip of --copy-times within the time "
                    "its activations wait, the step no longer) and lowers a rank's device peak\n");
  return 0;
}

/* Reads and parses --stage-times FILE; prints what is wrong and returns 1 when it cannot. */
static int read_costs(const char *path, zb__costs_t *out) {
  size_t len = 0;
  char *text = read_file(path, &len);
  if (!text) {
    fprintf(stderr, "zbpp: cannot read '%s': %s\n", path, strerror(errno));
    return 1;
  }
  char err[512];
  int ok = zb__costs_parse(text, len, path, out, err, sizeof err);
  free(text);
  if (!ok) {
    fprintf(stderr, "zbpp: %s\n", err);
    return 1;
  }
  return 0;
}

/* zb__costs_check_shape, printing its message; 0 when the cost file fits, else 1. */
static int costs_fit(const zb__costs_t *c, const char *path, int p, int v, int placement,
                     const char *source) {
  char err[512];
  if (zb__costs_check_shape(c, path, p, v, placement, source, err, sizeof err)) return 0;
  fprintf(stderr, "zbpp: %s\n", err);
  return 1;
}

/* The chunks zb_schedule_create picks when the spec says 0 (zbpp.h): with a cost file the tool
 * must know v before the call, since the library reads p * v values from the file's arrays. */
static int default_chunks(zb_kind_t kind) {
  return kind == ZB_KIND_INTERLEAVED_1F1B || kind == ZB_KIND_ZB_V || kind == ZB_KIND_V_HALF ||
                 kind == ZB_KIND_V_MIN
             ? 2
             : 1;
}

static int cmd_schedule(const args_t *a) {
  if (!a->kind) return zb__tool_bad_usage("%s", "schedule needs a KIND (see the list in --help)");
  zb_kind_t kind;
  double factor = 0;
  if (zb_kind_from_name(a->kind, &kind, &factor) != ZB_OK) return zb__tool_bad_usage("%s", zb__tool_error());
  if (a->p == INT_MIN)
    return zb__tool_bad_usage("%s", "schedule needs -p P, the number of pipeline ranks (>= 1)");
  if (a->m == INT_MIN)
    return zb__tool_bad_usage("%s", "schedule needs -m M, the number of microbatches (>= 1)");
  zb_schedule_spec_t spec = ZB_SCHEDULE_SPEC_INIT;
  spec.kind = kind;
  spec.ranks = a->p;
  spec.microbatches = a->m;
  spec.chunks = a->v;
  zb__costs_t costs, *have = NULL;
  char source[128];
  if (a->stage_times) {
    if (read_costs(a->stage_times, &costs)) return 1;
    have = &costs;
    spec.chunks = a->v ? a->v : default_chunks(kind);
    snprintf(source, sizeof source, "the command (%s, p = %d, v = %d) asks for", zb_kind_name(kind),
             a->p, spec.chunks);
  }
  if (a->placement >= 0) {
    spec.placement_set = 1, spec.placement = (zb_placement_t)a->placement;
  } else if (have && kind == ZB_KIND_ZB_AUTO && costs.placement >= 0) {
    /* zb-auto plans for the placement the costs were measured on. */
    spec.placement_set = 1, spec.placement = (zb_placement_t)costs.placement;
  }
  zb_schedule_t *s = NULL;
  int rc = have ? costs_fit(have, a->stage_times, a->p, spec.chunks, -1, source) : 0;
  if (!rc) rc = fill_costs(a, have, &spec, a->p);
  if (!rc && factor > 0 && !a->mem_limit) spec.mem_limit = factor * a->p;
  if (!rc && zb_schedule_create(&s, &spec) != ZB_OK) rc = zb__tool_fail("cannot generate the schedule");
  if (!rc && have) {
    /* The placement follows from the kind and v; the schedule itself says which it got. */
    zb_schedule_info_t info;
    zb_schedule_get_info(s, &info);
    rc = costs_fit(have, a->stage_times, info.ranks, info.chunks, (int)info.placement, source);
  }
  if (!rc) rc = apply_offload(a, &s, &spec);
  if (!rc) rc = emit(s, a);
  if (!rc && a->offload) rc = offload_summary(s, a);
  zb_schedule_destroy(s);
  if (have) zb__costs_free(have);
  return rc;
}

static int cmd_simulate(const args_t *a) {
  if (!a->file) return zb__tool_bad_usage("%s", "simulate needs a schedule file (CSV)");
  size_t len = 0;
  char *text = read_file(a->file, &len);
  if (!text) {
    fprintf(stderr, "zbpp: cannot read '%s': %s\n", a->file, strerror(errno));
    return 1;
  }
  zb__costs_t costs, *have = NULL;
  if (a->stage_times) {
    if (read_costs(a->stage_times, &costs)) {
      free(text);
      return 1;
    }
    have = &costs;
  }
  zb_schedule_spec_t spec = ZB_SCHEDULE_SPEC_INIT;
  int rc = fill_costs(a, NULL, &spec, 1);
  zb_schedule_t *s = NULL;
  size_t n = a->mem_limit ? strlen(a->mem_limit) : 0;
  int per_rank_limit = n > 1 && (a->mem_limit[n - 1] == 'p' || a->mem_limit[n - 1] == 'P');
  if (!rc && (per_rank_limit || have)) {
    /* 'Np' needs p, and a cost file must match p, v and the placement, all of which the schedule
     * file decides: parse it once without per-stage times to learn them. */
    if (zb_schedule_import(&s, ZB_FORMAT_CSV, text, len, &spec) != ZB_OK) {
      rc = zb__tool_fail(a->file);
    } else {
      zb_schedule_info_t info;
      zb_schedule_get_info(s, &info);
      zb_schedule_destroy(s);
      s = NULL;
      char source[1100];
      snprintf(source, sizeof source, "%.1000s has", a->file);
      if (have) rc = costs_fit(have, a->stage_times, info.ranks, info.chunks, (int)info.placement, source);
      spec.ranks = info.ranks; /* the import checks the arrays' length against ranks * chunks */
      spec.chunks = info.chunks;
      if (!rc) rc = fill_costs(a, have, &spec, info.ranks);
    }
  }
  if (!rc && zb_schedule_import(&s, ZB_FORMAT_CSV, text, len, &spec) != ZB_OK) rc = zb__tool_fail(a->file);
  free(text);
  if (!rc) rc = apply_offload(a, &s, NULL);
  if (!rc) rc = emit(s, a);
  if (!rc && a->offload) rc = offload_summary(s, a);
  zb_schedule_destroy(s);
  if (have) zb__costs_free(have);
  return rc;
}

int main(int argc, char **argv) {
  /* A file-size limit (ulimit -f) would otherwise kill the tool by SIGXFSZ in the middle of a
   * write, with no message; ignored, the write fails with EFBIG, which the tool reports. */
  signal(SIGXFSZ, SIG_IGN);
  /* A reader that stops early (zbpp schedule ... | head) closes the pipe: the write then fails
   * with EPIPE, and the tool stops quietly with status 0 (the reader had what it wanted) instead of
   * dying of SIGPIPE, which `set -o pipefail` would count as the pipeline's failure. Ignored
   * explicitly, so the tool behaves alike from a shell and from `python3 -m zbpp` (Python ignores
   * it and its exec'd children inherit that). */
  signal(SIGPIPE, SIG_IGN);
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
    usage(stdout);
    return 0;
  }
  if (!strcmp(argv[1], "--version")) {
    printf("zbpp %s\n", zb_version());
    return 0;
  }
  static const char *const commands[] = {"schedule", "simulate", "verify", "bench"};
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
    if (!strcmp(argv[1], commands[i])) tool_command = commands[i];
  if (!strcmp(argv[1], "verify")) return zb__tool_verify(argc, argv);
  if (!strcmp(argv[1], "bench")) return zb__tool_bench(argc, argv);
  if (strcmp(argv[1], "schedule") != 0 && strcmp(argv[1], "simulate") != 0)
    return zb__tool_bad_usage("unknown command '%s'; use schedule, simulate, verify or bench", argv[1]);
  for (int i = 2; i < argc; i++)
    if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
      schedule_usage(stdout, !strcmp(argv[1], "simulate"));
      return 0;
    }
  args_t a;
  int rc = parse_args(argc, argv, &a);
  if (rc) return rc;
  zb_format_t fmt;
  if (a.format && zb_format_from_name(a.format, &fmt) != ZB_OK) return zb__tool_bad_usage("%s", zb__tool_error());
  return !strcmp(a.command, "schedule") ? cmd_schedule(&a) : cmd_simulate(&a);
}
