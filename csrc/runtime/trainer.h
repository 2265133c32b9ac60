/*
 * trainer.h - trains the reference model with a schedule (ranks as threads, in-process transport)
 * and with a plain sequential single-rank loop, so the two can be compared bit for bit.
 *
 * What this is: the engine behind `zbpp verify`, `zbpp bench` and the runtime's C tests, kept in
 * one place so that what the tests prove is what the tool reports. What it is not: public API; a
 * real training job drives the runner through the binding.
 */
#ifndef ZB_RUNTIME_TRAINER_H
#define ZB_RUNTIME_TRAINER_H

#include "refmodel.h"
#include "zbpp.h"

typedef struct {
  zb__refmodel_config_t model; /* model.stages and model.microbatches must match the schedule */
  int32_t steps;
  zb_optimizer_config_t optim; /* kind, lr, clip, loss scale, post_validation; the pipeline fields
                                  (stages, rank, ranks, placement, transport) are filled in here */
  int32_t inject_nan_step;     /* < 0: none; else a NaN goes into the last stage's gradients then */
  double timeout_s;            /* runner and optimizer waits; <= 0: 60 s */
  int32_t empty_compute;       /* 1: callbacks do nothing and there is no optimizer (overhead runs) */
  /* Test hooks for failure handling: rank fail_rank's forward callback fails at its fail_op-th
   * forward of step 0; silent_rank never starts (as if its process hung). -1: off. */
  int32_t fail_rank, fail_op, silent_rank;
  /* Schedules with OFFLOAD/RELOAD: each copy lasts at least its schedule time times this many
   * seconds (zb_runner_config_t.copy_time_scale); the copies move the model's activations
   * (zb__refmodel_copy). */
  double copy_time_scale;
  /* > 0: F and B/BW callbacks last at least their schedule time times this many seconds (the
   * model's own work is much shorter), so a run follows its plan's timing; W runs as it is. */
  double compute_time_scale;
  int32_t copy_inline; /* zb_runner_config_t.copy_inline: copies on the rank's own thread */
} zb__train_config_t;

typedef struct {
  double *losses;         /* steps values, malloc'd (NaN where the run stopped early) */
  int32_t rolled_back_steps, skipped_steps, clipped_steps;
  double seconds;         /* wall time of all steps */
  double last_step_seconds;
  /* From the earliest start of step 1 on any rank to the latest end of the last step: the steps
   * after the first (warm-up) one. 0 when steps < 2. */
  double steady_seconds;
  /* Per-rank op times of every step (seconds, CLOCK_MONOTONIC): rank r's ops of step k start at
   * op_start[r][k * n_r], aligned with its rank ops (n_r of them); p arrays, malloc'd; NULL for the
   * sequential loop. zb__train_step_times picks one step out. */
  double **op_start, **op_end;
  int32_t p;
  /* Final parameters, one malloc'd fp32 array per stage (S of them) with sizes in param_count. */
  float **params;
  int64_t *param_count;
  int32_t S;
  /* Per rank (p entries, malloc'd): the most activation slots resident at once, and the most held
   * in host memory at once (zb__refmodel_memory), over all steps. */
  int64_t *resident_slots, *hosted_slots;
  /* On failure: each rank's status and message (p entries, malloc'd). */
  zb_status_t *rank_status;
  char **rank_error;
} zb__train_result_t;

/* Zeroes *res first. On failure returns the root error (a rank's own failure rather than the
 * "peer failed" echoes) with its message; res->rank_status/rank_error say what every rank saw. */
zb_status_t zb__train_pipeline(const zb_schedule_t *schedule, const zb__train_config_t *cfg,
                               zb__train_result_t *res);
/* The reference: one rank, every stage, F then B for each microbatch in order, then each stage's W
 * groups in order, then the synchronous optimizer step. */
zb_status_t zb__train_sequential(const zb__train_config_t *cfg, zb__train_result_t *res);
void zb__train_result_free(zb__train_result_t *res);
/* Fills start[r]/end[r] (p pointers each) with rank r's op times of `step`. */
void zb__train_step_times(const zb_schedule_t *schedule, const zb__train_result_t *res, int32_t step,
                          const double **start, const double **end);

/* Compares two results' parameters: *equal = all bits the same; *max_abs_diff over all values. */
void zb__train_compare(const zb__train_result_t *a, const zb__train_result_t *b, int *equal,
                       double *max_abs_diff);

#endif /* ZB_RUNTIME_TRAINER_H */
