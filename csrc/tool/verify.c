/*
 * verify.c - `zbpp verify`: trains the reference model with a schedule (ranks as threads) and with
 * a plain sequential single-rank loop from the same seed, and reports whether every parameter ended
 * bit-for-bit equal, the largest difference, the losses and what post-validation did.
 *
 * What this is for: a user's proof, on their own machine and for their own schedule choice, that the
 * runtime changes only when work happens, never what is computed. Exit 0 when equal, 1 when not
 * (or when the run failed), 2 on a usage error.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/trainer.h"
#include "tool.h"
#include "zbpp.h"

static void verify_usage(FILE *out) {
  fprintf(out,
          "Usage: zbpp verify KIND -p P -m M [options]\n"
          "\n"
          "Trains the reference model (Linear-GELU-Linear blocks with residuals, MSE loss) with the\n"
          "schedule, one thread per rank, and with a sequential loop from the same seed; reports\n"
          "whether every parameter is bit-for-bit equal after the steps.\n"
          "\n"
          "  -p P, -m M, -v V        ranks, microbatches, chunks per rank (as for zbpp schedule)\n"
          "  --mem-limit L|Np        memory limit (zb-auto's target)\n"
          "  --steps N               training steps (default 3)\n"
          "  --seed S                seed of weights and data (default 1)\n"
          "  --optimizer sgd|adamw   (default adamw)\n"
          "  --lr X                  learning rate (default 1e-2)\n"
          "  --post-validation       step speculatively and validate afterwards (the paper's section 4)\n"
          "  --clip C                clip the global gradient norm to C\n"
          "  --loss-scale S          initial loss scale (default 1024; halves on inf/NaN)\n"
          "  --inject-nan STEP       put a NaN into the last stage's gradients at that step\n"
          "  --width D, --ffn F, --layers L, --rows R   model size (default 16, 4D, 1 block per stage,\n"
          "                          8 rows per microbatch)\n"
          "  --timeout S             longest wait for a peer, seconds (default 60)\n"
          "  --json                  end with one JSON line: kind, steps, bitwise_equal, max_abs_diff,\n"
          "                          losses, rolled_back_steps, ...\n");
}

static void put_losses(const double *l, int n) {
  printf("[");
  for (int k = 0; k < n; k++) printf(isfinite(l[k]) ? "%s%.9g" : "%snull", k ? ", " : "", l[k]);
  printf("]");
}

int zb__tool_verify(int argc, char **argv) {
  const char *kind_name = NULL, *mem_limit = NULL, *optimizer = "adamw";
  int p = -1, m = -1, v = 0, steps = 3, json = 0, post = 0, inject = -1;
  int width = 16, ffn = 0, layers = 1, rows = 8, seed = 1;
  double clip = 0, lr = 1e-2, loss_scale = 1024, timeout = 60;
  for (int i = 2; i < argc; i++) {
    const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
    int *iopt = NULL;
    double *dopt = NULL;
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      verify_usage(stdout);
      return 0;
    } else if (!strcmp(a, "--json")) {
      json = 1;
      continue;
    } else if (!strcmp(a, "--post-validation")) {
      post = 1;
      continue;
    } else if (!strcmp(a, "-p") || !strcmp(a, "--ranks")) iopt = &p;
    else if (!strcmp(a, "-m") || !strcmp(a, "--microbatches")) iopt = &m;
    else if (!strcmp(a, "-v") || !strcmp(a, "--chunks")) iopt = &v;
    else if (!strcmp(a, "--steps")) iopt = &steps;
    else if (!strcmp(a, "--seed")) iopt = &seed;
    else if (!strcmp(a, "--inject-nan")) iopt = &inject;
    else if (!strcmp(a, "--width")) iopt = &width;
    else if (!strcmp(a, "--ffn")) iopt = &ffn;
    else if (!strcmp(a, "--layers")) iopt = &layers;
    else if (!strcmp(a, "--rows")) iopt = &rows;
    else if (!strcmp(a, "--clip")) dopt = &clip;
    else if (!strcmp(a, "--lr")) dopt = &lr;
    else if (!strcmp(a, "--loss-scale")) dopt = &loss_scale;
    else if (!strcmp(a, "--timeout")) dopt = &timeout;
    else if (!strcmp(a, "--optimizer") || !strcmp(a, "--mem-limit")) {
      if (!val) return zb__tool_bad_usage("option %s needs a value", a);
      if (!strcmp(a, "--optimizer")) optimizer = val;
      else mem_limit = val;
      i++;
      continue;
    } else if (a[0] == '-') {
      return zb__tool_bad_usage("verify: unknown option '%s'", a);
    } else if (!kind_name) {
      kind_name = a;
      continue;
    } else {
      return zb__tool_bad_usage("verify: unexpected argument '%s'", a);
    }
    if (!val) return zb__tool_bad_usage("option %s needs a value", a);
    i++;
    if (iopt && !zb__tool_parse_int(val, iopt)) return zb__tool_bad_value(a, "a whole number", val);
    if (dopt && !zb__tool_parse_double(val, dopt)) return zb__tool_bad_value(a, "a number", val);
    /* Options whose 0 (or a negative) would quietly mean "the default" or "off" downstream: the
     * library reads chunks 0 as the kind's default, ffn 0 here as 4 x width, clip_grad <= 0 as no
     * clipping, timeout <= 0 as 60 s, and a negative step as no injection. */
    if (iopt == &v && v < 1)
      return zb__tool_bad_value(a, "a whole number >= 1 (model chunks per rank; leave it out for the kind's default)", val);
    if (iopt == &ffn && ffn < 1) return zb__tool_bad_value(a, "a whole number >= 1 (leave it out for 4 x width)", val);
    if (iopt == &inject && inject < 0) return zb__tool_bad_value(a, "a step number >= 0", val);
    if (dopt == &clip && !(clip > 0 && isfinite(clip)))
      return zb__tool_bad_value(a, "a finite gradient norm > 0 (leave it out for no clipping)", val);
    if (dopt == &timeout && !(timeout > 0 && isfinite(timeout)))
      return zb__tool_bad_value(a, "a finite number of seconds > 0", val);
  }
  if (!kind_name) return zb__tool_bad_usage("%s", "verify needs a KIND (see zbpp --help)");
  if (p < 1) return zb__tool_bad_usage("%s", "verify needs -p P with P >= 1");
  if (m < 1) return zb__tool_bad_usage("%s", "verify needs -m M with M >= 1");
  if (steps < 1 || steps > 100000) return zb__tool_bad_usage("%s", "--steps must be in 1..100000");
  if (width < 1 || layers < 1 || rows < 1 || ffn < 0 || width > 4096 || ffn > 16384 || rows > 65536 || layers > 64)
    return zb__tool_bad_usage("%s", "model size out of range: --width 1..4096, --ffn 1..16384, --layers 1..64, --rows 1..65536");
  zb_optim_kind_t okind;
  if (!strcmp(optimizer, "sgd")) okind = ZB_OPTIM_SGD;
  else if (!strcmp(optimizer, "adamw")) okind = ZB_OPTIM_ADAMW;
  else return zb__tool_bad_usage("--optimizer wants sgd or adamw, got '%s'", optimizer);
  if (inject >= steps) return zb__tool_bad_usage("%s", "--inject-nan STEP must be below --steps (steps count from 0)");

  zb_kind_t kind;
  double factor = 0;
  if (zb_kind_from_name(kind_name, &kind, &factor) != ZB_OK) return zb__tool_bad_usage("%s", zb__tool_error());
  zb_schedule_spec_t spec = ZB_SCHEDULE_SPEC_INIT;
  spec.kind = kind, spec.ranks = p, spec.microbatches = m, spec.chunks = v;
  if (factor > 0) spec.mem_limit = factor * p;
  if (mem_limit) {
    size_t n = strlen(mem_limit);
    double x;
    char buf[64];
    snprintf(buf, sizeof buf, "%s", mem_limit);
    int per_p = n > 1 && n < sizeof buf && (buf[n - 1] == 'p' || buf[n - 1] == 'P');
    if (per_p) buf[n - 1] = '\0';
    if (!zb__tool_parse_double(buf, &x) || !(x > 0))
      return zb__tool_bad_usage("--mem-limit wants a positive number or Np, got '%s'", mem_limit);
    spec.mem_limit = per_p ? x * p : x;
  }
  zb_schedule_t *s = NULL;
  if (zb_schedule_create(&s, &spec) != ZB_OK) return zb__tool_fail("cannot generate the schedule");
  zb_schedule_info_t info;
  zb_schedule_get_info(s, &info);

  zb__train_config_t cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.model = (zb__refmodel_config_t){info.stages, layers, width, ffn ? ffn : 4 * width, rows, m, (uint64_t)seed};
  cfg.steps = steps;
  zb_optimizer_config_t oc = ZB_OPTIMIZER_CONFIG_INIT;
  oc.kind = okind, oc.lr = lr, oc.clip_grad = clip, oc.loss_scale = loss_scale, oc.post_validation = post;
  if (okind == ZB_OPTIM_SGD) oc.momentum = 0.9;
  cfg.optim = oc;
  cfg.inject_nan_step = inject;
  cfg.timeout_s = timeout;
  cfg.fail_rank = cfg.fail_op = cfg.silent_rank = -1;

  zb__tool_one_blas_thread();
  fprintf(stderr, "zbpp verify: %s p=%d v=%d m=%d, %d step(s), %s%s; %d stages x %d block(s), d=%d f=%d, %d rows\n",
          zb_kind_name(info.kind), info.ranks, info.chunks, m, steps, optimizer,
          post ? " with post-validation" : "", info.stages, layers, width, cfg.model.ffn, rows);
  zb__train_result_t piped, seq;
  zb_status_t st = zb__train_pipeline(s, &cfg, &piped);
  if (st != ZB_OK) {
    int rc = zb__tool_fail("the pipelined run failed");
    for (int r = 0; r < piped.p; r++)
      if (piped.rank_status && piped.rank_status[r] != ZB_OK)
        fprintf(stderr, "  rank %d: %s\n", r, zb__tool_plain(piped.rank_error[r]));
    zb__train_result_free(&piped);
    zb_schedule_destroy(s);
    return rc;
  }
  if (zb__train_sequential(&cfg, &seq) != ZB_OK) {
    zb__train_result_free(&piped);
    zb_schedule_destroy(s);
    return zb__tool_fail("the sequential run failed");
  }
  int equal;
  double diff;
  zb__train_compare(&piped, &seq, &equal, &diff);
  int64_t values = 0;
  for (int st2 = 0; st2 < seq.S; st2++) values += seq.param_count[st2];
  int losses_equal = memcmp(piped.losses, seq.losses, (size_t)steps * sizeof(double)) == 0;

  printf("step  loss (pipelined)  loss (sequential)\n");
  for (int k = 0; k < steps; k++) printf("%4d  %-16.9g  %-16.9g\n", k, piped.losses[k], seq.losses[k]);
  printf("parameters: %s (%lld values in %d stages, max |difference| %g)\n",
         equal ? "bit-for-bit equal" : "NOT equal", (long long)values, seq.S, diff);
  printf("losses: %s\n", losses_equal ? "bit-for-bit equal" : "NOT equal");
  printf("optimizer: %d step(s) clipped, %d skipped for inf/NaN", piped.clipped_steps, piped.skipped_steps);
  if (post) printf(", %d rolled back by post-validation", piped.rolled_back_steps);
  printf("\n");
  if (json) {
    printf("{\"kind\": \"%s\", \"ranks\": %d, \"chunks\": %d, \"microbatches\": %d, \"steps\": %d, "
           "\"optimizer\": \"%s\", \"post_validation\": %s, \"bitwise_equal\": %s, \"losses_equal\": %s, "
           "\"max_abs_diff\": %.17g, \"losses\": ",
           zb_kind_name(info.kind), info.ranks, info.chunks, m, steps, optimizer, post ? "true" : "false",
           equal ? "true" : "false", losses_equal ? "true" : "false", isfinite(diff) ? diff : 1e308);
    put_losses(piped.losses, steps);
    printf(", \"losses_sequential\": ");
    put_losses(seq.losses, steps);
    printf(", \"rolled_back_steps\": %d, \"skipped_steps\": %d, \"clipped_steps\": %d, "
           "\"parameters\": %lld, \"seconds\": %.6f}\n",
           piped.rolled_back_steps, piped.skipped_steps, piped.clipped_steps, (long long)values, piped.seconds);
  }
  zb__train_result_free(&piped);
  zb__train_result_free(&seq);
  zb_schedule_destroy(s);
  return equal && losses_equal ? 0 : 1;
}
