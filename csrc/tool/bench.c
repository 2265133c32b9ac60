/*
 * bench.c - `zbpp bench`: the reference model on real threads (one per rank), every schedule kind
 * at the same model size. For each kind it first checks that the pipelined parameters equal the
 * sequential loop's bit for bit, then times steady-state steps and prints iterations per second,
 * the measured bubble rate (averaged over the timed steps) next to the simulated one. Every kind is
 * planned with this machine's costs: a 3-step profile of its unit-cost schedule gives per-stage
 * F/B/W/BW times, and the schedule is generated again from them, as a user feeds measured costs
 * back; the simulated bubble is that plan's. Finally the runner's own overhead per op with empty
 * compute and the W store's push/pop cost.
 *
 * What this is not: a GPU benchmark. Ranks share the machine's cores, so use p <= cores.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backend/internal.h"
#include "runtime/internal.h"
#include "runtime/trainer.h"
#include "tool.h"
#include "zbpp.h"

static void bench_usage(FILE *out) {
  fprintf(out,
          "Usage: zbpp bench [options]\n"
          "\n"
          "  -p P            ranks, one thread each (default: the number of CPUs, 2..4)\n"
          "  -m M            microbatches (default 4p)\n"
          "  --steps N       timed steps after one warm-up step (default 10)\n"
          "  --width D       model width (default 256); --ffn F (default 4D)\n"
          "  --layers L      blocks per rank (default 2; split over the chunks of V and interleaved\n"
          "                  kinds, so every kind trains the same model); --rows R rows per\n"
          "                  microbatch (default 64)\n"
          "  --kinds a,b,..  the kinds to run (default: all)\n");
}

static zb__train_config_t make_config(int S, int m, int steps, int width, int ffn, int layers, int rows) {
  zb__train_config_t c;
  memset(&c, 0, sizeof c);
  c.model = (zb__refmodel_config_t){S, layers, width, ffn, rows, m, 7};
  c.steps = steps;
  zb_optimizer_config_t oc = ZB_OPTIMIZER_CONFIG_INIT;
  oc.lr = 1e-3;
  c.optim = oc;
  c.inject_nan_step = -1;
  c.timeout_s = 120;
  c.fail_rank = c.fail_op = c.silent_rank = -1;
  return c;
}

/* Mean per-stage op times (ms) over steps 1..steps-1 of a run; fused-only kinds get B = W = BW/2
 * and split kinds BW = B + W, so the spec has every cost a generator may use. */
static void mean_costs(zb_schedule_t *s, const zb__train_result_t *res, int steps, int S, double *t) {
  double *one = calloc((size_t)S * 4, sizeof(double));
  const double **st = calloc((size_t)res->p * 2, sizeof(double *));
  memset(t, 0, (size_t)S * 4 * sizeof(double));
  for (int step = 1; one && st && step < steps; step++) {
    zb__train_step_times(s, res, step, st, st + res->p);
    if (zb_schedule_set_times(s, st, st + res->p, NULL) != ZB_OK) break;
    zb_schedule_stage_costs(s, one, one + S, one + 2 * S, one + 3 * S);
    for (int k = 0; k < 4 * S; k++) t[k] += one[k] / (steps - 1);
  }
  for (int k = 0; k < S; k++) {
    if (t[3 * S + k] == 0) t[3 * S + k] = t[S + k] + t[2 * S + k];
    if (t[S + k] == 0 && t[2 * S + k] == 0) t[S + k] = t[2 * S + k] = t[3 * S + k] / 2;
  }
  free(one), free(st);
}

/* Runner overhead: empty callbacks, so each op is the runner's bookkeeping (and, with p > 1, the
 * in-process hand-over between threads). Returns microseconds per op on the busiest rank. */
static double overhead_per_op(int p, int m, int steps) {
  zb_schedule_spec_t spec = ZB_SCHEDULE_SPEC_INIT;
  spec.kind = ZB_KIND_ZB_H1, spec.ranks = p, spec.microbatches = m;
  zb_schedule_t *s;
  if (zb_schedule_create(&s, &spec) != ZB_OK) return NAN;
  zb__train_config_t cfg = make_config(p, m, steps, 1, 1, 1, 1);
  cfg.empty_compute = 1;
  zb__train_result_t res;
  double us = NAN;
  if (zb__train_pipeline(s, &cfg, &res) == ZB_OK) {
    const zb_op_t *ops;
    int32_t n;
    zb_schedule_rank_ops(s, 0, &ops, &n);
    us = res.steady_seconds / (steps - 1) / n * 1e6;
  }
  zb__train_result_free(&res);
  zb_schedule_destroy(s);
  return us;
}

/* The W store alone: begin, push two entries, end, pop (entries with zero rows skip the GEMM). */
static double wstore_ns(int iters) {
  zb_backend_t *be;
  zb_wstore_t *ws;
  if (zb_backend_create_host(&be) != ZB_OK) return NAN;
  if (zb_wstore_create(&ws, be, NULL, NULL) != ZB_OK) {
    zb_backend_destroy(be);
    return NAN;
  }
  float dummy = 0;
  zb_wgrad_t e = {sizeof(zb_wgrad_t), ZB_DTYPE_F32, 0, 1, 1, &dummy, 0, &dummy, 0, &dummy, NULL, 0, ZB_DTYPE_F32, 0};
  double t0 = zb__now();
  for (int k = 0; k < iters; k++) {
    zb_wstore_begin(ws, 0, k);
    zb_wstore_push(ws, &e);
    zb_wstore_push(ws, &e);
    zb_wstore_end(ws);
    zb_wstore_pop_run(ws, 0, NULL);
  }
  double ns = (zb__now() - t0) / iters * 1e9;
  zb_wstore_destroy(ws);
  zb_backend_destroy(be);
  return ns;
}

/* Parses --kinds "a,b,...": every item must be a kind the library can generate (any name
 * zb_kind_from_name takes), or nothing runs that the user asked for. Returns 0 or a usage exit. */
static int parse_kinds(const char *list, int *selected) {
  char buf[512];
  if (strlen(list) >= sizeof buf) return zb__tool_bad_usage("bench: --kinds '%.100s...' is too long", list);
  strcpy(buf, list);
  char *save = NULL;
  int n = 0;
  for (char *item = strtok_r(buf, ",", &save); item; item = strtok_r(NULL, ",", &save), n++) {
    zb_kind_t kind;
    double factor = 0;
    if (zb_kind_from_name(item, &kind, &factor) != ZB_OK) {
      char msg[1024];
      snprintf(msg, sizeof msg, "bench --kinds: %s", zb__tool_error());
      return zb__tool_bad_usage("%s", msg);
    }
    if (factor > 0) /* bench plans every kind without a memory limit; it would drop this one's */
      return zb__tool_bad_usage("bench --kinds: '%s' is zb-auto under a memory limit, which bench does "
                                "not set; use zb-auto",
                                item);
    selected[kind] = 1;
  }
  if (n == 0) return zb__tool_bad_usage("bench --kinds wants a comma-separated list of kinds, got '%s'", list);
  return 0;
}

int zb__tool_bench(int argc, char **argv) {
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  int p = cpus < 2 ? 2 : cpus > 4 ? 4 : (int)cpus, m = 0, steps = 10, width = 256, ffn = 0, layers = 2, rows = 64;
  int selected[ZB_KIND_COUNT], have_kinds = 0;
  memset(selected, 0, sizeof selected);
  for (int i = 2; i < argc; i++) {
    const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
    int *iopt = NULL;
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      bench_usage(stdout);
      return 0;
    } else if (!strcmp(a, "-p")) iopt = &p;
    else if (!strcmp(a, "-m")) iopt = &m;
    else if (!strcmp(a, "--steps")) iopt = &steps;
    else if (!strcmp(a, "--width")) iopt = &width;
    else if (!strcmp(a, "--ffn")) iopt = &ffn;
    else if (!strcmp(a, "--layers")) iopt = &layers;
    else if (!strcmp(a, "--rows")) iopt = &rows;
    else if (!strcmp(a, "--kinds")) {
      if (!val) return zb__tool_bad_usage("option %s needs a value", a);
      int rc = parse_kinds(val, selected);
      if (rc) return rc;
      have_kinds = 1;
      i++;
      continue;
    } else return zb__tool_bad_usage("bench: unknown argument '%s'", a);
    if (!val) return zb__tool_bad_usage("option %s needs a value", a);
    i++;
    /* Every size is >= 1 when given: 0 must not quietly mean "the default" (m and ffn have one). */
    if (!zb__tool_parse_int(val, iopt) || *iopt < 1) return zb__tool_bad_value(a, "a whole number >= 1", val);
  }
  if (m == 0) m = 4 * p;
  if (ffn == 0) ffn = 4 * width;
  if (p < 1 || p > 64 || m < 1 || steps < 1 || width < 1 || ffn < 1 || layers < 1 || rows < 1 ||
      width > 8192 || ffn > 32768 || rows > 65536 || layers > 64)
    return zb__tool_bad_usage("%s", "bench: sizes out of range (p 1..64; m, steps, width, ffn, layers, rows >= 1)");

  zb__tool_one_blas_thread();
  printf("zbpp bench: %d ranks as threads on %ld CPU(s); m=%d; %d blocks per rank, d=%d f=%d, %d rows; "
         "%d timed step(s) after 1 warm-up\nBLAS: %s\n\n",
         p, cpus, m, layers, width, ffn, rows, steps, zb__host_blas_name());
  printf("%-17s %2s %6s  %9s %8s  %9s %9s\n", "kind", "v", "stages", "check", "it/s", "bubble", "bubble");
  printf("%-17s %2s %6s  %9s %8s  %9s %9s\n", "", "", "", "", "", "measured", "simulated");
  int failures = 0;
  for (int k = 0; k < ZB_KIND_CUSTOM; k++) {
    const char *name = zb_kind_name((zb_kind_t)k);
    if (have_kinds && !selected[k]) continue;
    /* Plan with the costs this machine has: profile the kind's unit-cost schedule for 3 steps,
     * then generate it again from the measured per-stage F/B/W/BW times, as a user would. */
    zb_schedule_spec_t spec = ZB_SCHEDULE_SPEC_INIT;
    spec.kind = (zb_kind_t)k, spec.ranks = p, spec.microbatches = m;
    zb_schedule_t *s0 = NULL, *s = NULL;
    if (zb_schedule_create(&s0, &spec) != ZB_OK) {
      printf("%-17s (not generated: %s)\n", name, zb__tool_error());
      continue;
    }
    zb_schedule_info_t info;
    zb_schedule_get_info(s0, &info);
    int lps = layers / info.chunks; /* the same model for every kind: layers blocks per rank */
    if (lps < 1 || lps * info.chunks != layers) {
      printf("%-17s (skipped: --layers %d does not split into %d chunks)\n", name, layers, info.chunks);
      zb_schedule_destroy(s0);
      continue;
    }
    zb__train_config_t prof = make_config(info.stages, m, 3, width, ffn, lps, rows);
    zb__train_result_t pr;
    double *t = calloc((size_t)info.stages * 4, sizeof(double));
    zb_sim_result_t plan;
    int planned = t && zb__train_pipeline(s0, &prof, &pr) == ZB_OK;
    if (planned) {
      mean_costs(s0, &pr, 3, info.stages, t);
      spec.chunks = info.chunks;
      spec.stage_time_f = t, spec.stage_time_b = t + info.stages;
      spec.stage_time_w = t + 2 * info.stages, spec.stage_time_bw = t + 3 * info.stages;
      planned = zb_schedule_create(&s, &spec) == ZB_OK && zb_schedule_simulate(s, &plan) == ZB_OK;
    }
    zb__train_result_free(&pr);
    free(t);
    zb_schedule_destroy(s0);
    if (!planned) {
      printf("%-17s failed to plan: %s\n", name, zb__tool_error());
      failures++;
      zb_schedule_destroy(s);
      continue;
    }
    /* Correctness first: 2 steps against the sequential loop, bit for bit. */
    zb__train_config_t check = make_config(info.stages, m, 2, width, ffn, lps, rows);
    zb__train_result_t a, b;
    int equal = 0;
    double diff = 0;
    if (zb__train_pipeline(s, &check, &a) == ZB_OK && zb__train_sequential(&check, &b) == ZB_OK) {
      zb__train_compare(&a, &b, &equal, &diff);
      zb__train_result_free(&b);
    } else {
      printf("%-17s failed: %s\n", name, zb__tool_error());
    }
    zb__train_result_free(&a);
    if (!equal) {
      failures++;
      printf("%-17s %2d %6d  %9s (max |diff| %g): not timed\n", name, info.chunks, info.stages, "MISMATCH", diff);
      zb_schedule_destroy(s);
      continue;
    }
    zb__train_config_t cfg = make_config(info.stages, m, steps + 1, width, ffn, lps, rows);
    zb__train_result_t res;
    if (zb__train_pipeline(s, &cfg, &res) != ZB_OK) {
      printf("%-17s failed: %s\n", name, zb__tool_error());
      failures++;
      zb__train_result_free(&res);
      zb_schedule_destroy(s);
      continue;
    }
    double its = steps / res.steady_seconds, meas_sum = 0;
    int ok = 1;
    /* The bubble of each timed step, averaged: one step on a shared machine is noisy. */
    const double **st = calloc((size_t)info.ranks * 2, sizeof(double *));
    for (int step = 1; ok && st && step <= steps; step++) {
      zb_sim_result_t meas;
      zb__train_step_times(s, &res, step, st, st + info.ranks);
      ok = zb_schedule_set_times(s, st, st + info.ranks, &meas) == ZB_OK;
      meas_sum += meas.bubble_rate;
    }
    free(st);
    if (ok)
      printf("%-17s %2d %6d  %9s %8.2f  %8.1f%% %8.1f%%\n", name, info.chunks, info.stages, "bitwise", its,
             100 * meas_sum / steps, 100 * plan.bubble_rate);
    else
      printf("%-17s %2d %6d  %9s %8.2f  (timeline: %s)\n", name, info.chunks, info.stages, "bitwise", its,
             zb__tool_error());
    fflush(stdout);
    zb__train_result_free(&res);
    zb_schedule_destroy(s);
  }

  printf("\nruntime overhead (empty compute, zb-h1, in-process transport):\n");
  printf("  p=1 (bookkeeping only):          %7.2f us per op\n", overhead_per_op(1, 64, 21));
  printf("  p=2 (with thread hand-over):     %7.2f us per op\n", overhead_per_op(2, 64, 21));
  if (p > 2) printf("  p=%d:                             %7.2f us per op\n", p, overhead_per_op(p, 64, 21));
  printf("  W store begin+2 pushes+end+pop:  %7.1f ns\n", wstore_ns(1000000));
  return failures ? 1 : 0;
}
