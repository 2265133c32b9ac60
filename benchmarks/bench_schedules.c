/*
 * bench_schedules.c - bubble rates of every schedule on the Zero Bubble paper's four profiled
 * settings (its Table 3 inputs), and how long each took to generate.
 *
 * Correctness first: every schedule is validated, zb-auto is checked to be no longer than the
 * handcrafted schedules that fit its limit, and no schedule may go below zb_schedule_cost_bound (a
 * cost no schedule of that shape, costs and memory limit can beat, whatever its order); a failed
 * check exits 1. Then the table, then the large case (zb-auto at p = 64, m = 1024), timed.
 *
 * The "bound" columns are the bubble rate of a schedule that met the bound at limits p and 2p (the
 * memory of 1F1B and of ZB-H2): no schedule within that memory can show less, so the gap between
 * auto(p) and bound(p) is the most any scheduler could still win there.
 *
 * Inputs (ms per microbatch through a rank's layers): T_F/T_B/T_W/T_comm as profiled in the paper;
 * w-share = 32h/(34h + 5as) with s = 1024 (the share of activations only W needs).
 */
#define _POSIX_C_SOURCE 199309L /* clock_gettime under -std=c11 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "zbpp.h"

typedef struct {
  const char *model;
  int p;
  double f, b, w, comm;
  int h, a;
} setting_t;

static const setting_t settings[] = {
    {"1.5B", 8, 18.5, 18.1, 9.3, 0.60, 2304, 24},
    {"6.2B", 8, 29.7, 29.4, 19.9, 0.53, 4096, 32},
    {"14.6B", 16, 11.3, 11.2, 8.1, 0.38, 5120, 40},
    {"28.3B", 32, 10.4, 10.2, 7.7, 0.41, 6144, 48},
};

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

typedef struct {
  const char *label;
  zb_kind_t kind;
  int v;
  double limit_factor; /* limit = factor * p; 0: none */
} column_t;

static const column_t columns[] = {
    {"1F1B", ZB_KIND_1F1B, 1, 0},         {"Interl.", ZB_KIND_INTERLEAVED_1F1B, 2, 0},
    {"ZB-H1", ZB_KIND_ZB_H1, 1, 0},       {"ZB-H2", ZB_KIND_ZB_H2, 1, 0},
    {"auto(p)", ZB_KIND_ZB_AUTO, 1, 1},   {"auto(2p)", ZB_KIND_ZB_AUTO, 1, 2},
    {"ZB-V", ZB_KIND_ZB_V, 2, 0},
};
#define NCOL (int)(sizeof columns / sizeof columns[0])

static int make(const setting_t *st, const column_t *c, int m, zb_sim_result_t *res, double *ms,
                double *bound) {
  zb_schedule_spec_t spec = ZB_SCHEDULE_SPEC_INIT;
  spec.kind = c->kind;
  spec.ranks = st->p;
  spec.chunks = c->v;
  spec.microbatches = m;
  spec.time_f = st->f;
  spec.time_b = st->b;
  spec.time_w = st->w;
  spec.time_comm = st->comm;
  spec.w_share = 32.0 * st->h / (34.0 * st->h + 5.0 * st->a * 1024);
  spec.mem_limit = c->limit_factor * st->p;
  zb_schedule_t *s = NULL;
  double t0 = now_ms();
  if (zb_schedule_create(&s, &spec) != ZB_OK || zb_schedule_simulate(s, res) != ZB_OK) {
    fprintf(stderr, "FAILED: %s p=%d m=%d: %s\n", c->label, st->p, m, zb_last_error());
    zb_schedule_destroy(s);
    return 1;
  }
  *ms = now_ms() - t0;
  if (zb_schedule_validate(s) != ZB_OK) {
    fprintf(stderr, "INVALID: %s p=%d m=%d: %s\n", c->label, st->p, m, zb_last_error());
    zb_schedule_destroy(s);
    return 1;
  }
  if (zb_schedule_cost_bound(s, bound) != ZB_OK || res->cost < *bound - 1e-6) {
    fprintf(stderr, "CHECK: %s p=%d m=%d cost %.3f below its bound %.3f (%s)\n", c->label, st->p, m,
            res->cost, *bound, zb_last_error());
    zb_schedule_destroy(s);
    return 1;
  }
  zb_schedule_destroy(s);
  return 0;
}

int main(void) {
  int failures = 0;
  printf("Bubble rate (%%) per schedule; generation time in ms in brackets.\n");
  printf("%-6s %3s %4s", "model", "p", "m");
  for (int c = 0; c < NCOL; c++) printf(" %16s", columns[c].label);
  printf(" %9s %9s\n", "bound(p)", "bound(2p)");
  for (size_t i = 0; i < sizeof settings / sizeof settings[0]; i++) {
    const setting_t *st = &settings[i];
    const int ms_list[] = {3 * st->p, 4 * st->p, 8 * st->p};
    for (int j = 0; j < 3; j++) {
      int m = ms_list[j];
      zb_sim_result_t r[NCOL];
      double ms[NCOL], bound[NCOL];
      for (int c = 0; c < NCOL; c++) failures += make(st, &columns[c], m, &r[c], &ms[c], &bound[c]);
      /* zb-auto must not lose to a handcrafted schedule that fits the same limit. */
      if (r[4].cost > r[2].cost + 1e-9 || r[4].cost > r[0].cost + 1e-9) {
        fprintf(stderr, "CHECK: auto(p) cost %.3f > ZB-H1 %.3f or 1F1B %.3f (%s m=%d)\n", r[4].cost,
                r[2].cost, r[0].cost, st->model, m);
        failures++;
      }
      if (r[5].cost > r[3].cost + 1e-9) {
        fprintf(stderr, "CHECK: auto(2p) cost %.3f > ZB-H2 %.3f (%s m=%d)\n", r[5].cost, r[3].cost,
                st->model, m);
        failures++;
      }
      printf("%-6s %3d %4d", st->model, st->p, m);
      for (int c = 0; c < NCOL; c++) {
        char cell[32];
        snprintf(cell, sizeof cell, "%.2f [%.0f]", 100 * r[c].bubble_rate, ms[c]);
        printf(" %16s", cell);
      }
      /* bound[4] and bound[5]: the auto(p) and auto(2p) schedules', at limits p and 2p. */
      double busy = m * (st->f + st->b + st->w);
      printf(" %9.2f %9.2f\n", fmax(0, 100 * (bound[4] - busy) / bound[4]), fmax(0, 100 * (bound[5] - busy) / bound[5]));
    }
  }

  /* The large case: zb-auto at p = 64, m = 1024 with the 28.3B setting's costs. */
  setting_t big = settings[3];
  big.p = 64;
  column_t autop = {"auto(p)", ZB_KIND_ZB_AUTO, 1, 1};
  zb_sim_result_t r;
  double ms;
  double big_bound;
  failures += make(&big, &autop, 1024, &r, &ms, &big_bound);
  printf("\nzb-auto p=64 m=1024 (28.3B costs): generate+simulate %.0f ms, bubble %.2f%% (bound %.2f%%)\n", ms,
         100 * r.bubble_rate, 100 * (big_bound - r.busy) / big_bound);
  if (failures) {
    fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  return 0;
}
