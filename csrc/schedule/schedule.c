/*
 * schedule.c - the schedule handle: creation from a spec (argument checks, then the kind's
 * generator), explicit op lists, accessors and destruction.
 *
 * What this is not: a generator, the validator or the simulator; those live in their own files.
 */
#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

const char *zb__op_name(int type) {
  switch (type) {
    case ZB_OP_F: return "F";
    case ZB_OP_B: return "B";
    case ZB_OP_W: return "W";
    case ZB_OP_BW: return "BW";
    case ZB_OP_OFFLOAD: return "OFFLOAD";
    case ZB_OP_RELOAD: return "RELOAD";
    case ZB_OP_S: return "S";
    case ZB_OP_T: return "T";
    case ZB_OP_IF: return "IF";
    case ZB_OP_IB: return "IB";
    default: return "?";
  }
}

/* ---- kinds ------------------------------------------------------------------------------------ */

const char *zb_kind_name(zb_kind_t kind) {
  switch (kind) {
#define ZB_X_CASE(name, value, text, help)                                                         \
  case name:                                                                                       \
    return text;
    ZB_KIND_LIST(ZB_X_CASE)
#undef ZB_X_CASE
  }
  return NULL;
}

const char *zb_kind_help(zb_kind_t kind) {
  switch (kind) {
#define ZB_X_CASE(name, value, text, help)                                                         \
  case name:                                                                                       \
    return help;
    ZB_KIND_LIST(ZB_X_CASE)
#undef ZB_X_CASE
  }
  return NULL;
}

/* Lower-cases and drops '-', '_' and spaces, so "ZB_V", "zb-v" and "ZBV" compare equal. */
static void normalise(const char *in, char *out, size_t cap) {
  size_t n = 0;
  for (; *in && n + 1 < cap; in++) {
    if (*in == '-' || *in == '_' || *in == ' ') continue;
    out[n++] = (char)tolower((unsigned char)*in);
  }
  out[n] = '\0';
}

zb_status_t zb_kind_from_name(const char *name, zb_kind_t *out_kind, double *out_factor) {
  ZB_ARG_NOT_NULL(name);
  ZB_ARG_NOT_NULL(out_kind);
  static const struct {
    const char *alias;
    zb_kind_t kind;
    double factor;
  } aliases[] = {
      /* torch.distributed.pipelining's schedule class names (without the "Schedule" prefix too). */
      {"schedule1f1b", ZB_KIND_1F1B, 0},
      {"pipedreamflush", ZB_KIND_1F1B, 0},
      {"interleaved1f1b", ZB_KIND_INTERLEAVED_1F1B, 0},
      {"scheduleinterleaved1f1b", ZB_KIND_INTERLEAVED_1F1B, 0},
      {"schedulegpipe", ZB_KIND_GPIPE, 0},
      {"zbvzerobubble", ZB_KIND_ZB_V, 0},
      {"schedulezbvzerobubble", ZB_KIND_ZB_V, 0},
      /* torch's InterleavedZeroBubble is a loop-placed zero-bubble schedule; ours is zb-auto. */
      {"interleavedzerobubble", ZB_KIND_ZB_AUTO, 0},
      {"scheduleinterleavedzerobubble", ZB_KIND_ZB_AUTO, 0},
      {"zb1p", ZB_KIND_ZB_AUTO, 1},
      {"zb2p", ZB_KIND_ZB_AUTO, 2},
      {"zbauto", ZB_KIND_ZB_AUTO, 0},
      {"vzb", ZB_KIND_ZB_V, 0},
      {"vhalf", ZB_KIND_V_HALF, 0},
      {"gis", ZB_KIND_GROUP_INTERLEAVED_1F1B, 0},
      {"vmin", ZB_KIND_V_MIN, 0},
  };
  char want[64], have[64];
  normalise(name, want, sizeof want);
  for (int k = 0; k < ZB_KIND_COUNT; k++) {
    normalise(zb_kind_name((zb_kind_t)k), have, sizeof have);
    if (strcmp(want, have) == 0 && k != ZB_KIND_CUSTOM) {
      *out_kind = (zb_kind_t)k;
      if (out_factor) *out_factor = 0;
      return ZB_OK;
    }
  }
  for (size_t i = 0; i < sizeof aliases / sizeof aliases[0]; i++) {
    if (strcmp(want, aliases[i].alias) == 0) {
      *out_kind = aliases[i].kind;
      if (out_factor) *out_factor = aliases[i].factor;
      return ZB_OK;
    }
  }
  return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                 "unknown schedule kind '%s'; valid kinds: gpipe, 1f1b, interleaved-1f1b, zb-h1, "
                 "zb-h2, zb-v, v-half, v-min, zb-auto (also zb-1p, zb-2p, and torch's 1F1B, "
                 "Interleaved1F1B, GPipe, InterleavedZeroBubble, ZBVZeroBubble)",
                 name);
}

/* ---- op lists while generating ---------------------------------------------------------------- */

zb_status_t zb__oplists_init(zb__oplists_t *l, int p) {
  memset(l, 0, sizeof *l);
  l->p = p;
  l->list = calloc((size_t)p, sizeof *l->list);
  l->t0 = calloc((size_t)p, sizeof *l->t0);
  l->t1 = calloc((size_t)p, sizeof *l->t1);
  l->count = calloc((size_t)p, sizeof *l->count);
  l->cap = calloc((size_t)p, sizeof *l->cap);
  if (!l->list || !l->t0 || !l->t1 || !l->count || !l->cap) {
    zb__oplists_free(l);
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory allocating op lists for %d ranks", p);
  }
  return ZB_OK;
}

zb_status_t zb__oplists_push_timed(zb__oplists_t *l, int rank, int type, int stage, int mb,
                                   double start, double end) {
  if (l->count[rank] == l->cap[rank]) {
    int cap = l->cap[rank] ? 2 * l->cap[rank] : 64;
    zb_op_t *grown = realloc(l->list[rank], (size_t)cap * sizeof *grown);
    if (grown) l->list[rank] = grown;
    double *a = grown ? realloc(l->t0[rank], (size_t)cap * sizeof *a) : NULL;
    if (a) l->t0[rank] = a;
    double *b = a ? realloc(l->t1[rank], (size_t)cap * sizeof *b) : NULL;
    if (b) l->t1[rank] = b;
    if (!b) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory growing rank %d's op list", rank);
    l->cap[rank] = cap;
  }
  int i = l->count[rank]++;
  l->list[rank][i] = (zb_op_t){type, stage, mb};
  l->t0[rank][i] = start;
  l->t1[rank][i] = end;
  return ZB_OK;
}

zb_status_t zb__oplists_push(zb__oplists_t *l, int rank, int type, int stage, int mb) {
  l->untimed = 1;
  return zb__oplists_push_timed(l, rank, type, stage, mb, 0, 0);
}

void zb__oplists_free(zb__oplists_t *l) {
  for (int r = 0; r < l->p; r++) {
    if (l->list) free(l->list[r]);
    if (l->t0) free(l->t0[r]);
    if (l->t1) free(l->t1[r]);
  }
  free(l->list), free(l->t0), free(l->t1);
  free(l->count);
  free(l->cap);
  memset(l, 0, sizeof *l);
}

zb_status_t zb__schedule_take_ops(zb_schedule_t *s, zb__oplists_t *l) {
  int total = 0;
  for (int r = 0; r < l->p; r++) total += l->count[r];
  size_t n = (size_t)(total ? total : 1);
  zb_op_t *ops = malloc(n * sizeof *ops);
  if (!ops) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for %d ops", total);
  int k = 0;
  for (int r = 0; r < l->p; r++) {
    s->rank_off[r] = k;
    if (l->count[r]) memcpy(ops + k, l->list[r], (size_t)l->count[r] * sizeof *ops);
    k += l->count[r];
  }
  s->rank_off[l->p] = k;
  free(s->ops);
  s->ops = ops;
  s->n_ops = total;
  zb__schedule_invalidate(s);
  if (!l->untimed) {
    /* The generator timed every op as the simulator would (greedy.c, placer.c): keep those times
     * instead of simulating again. test_generators checks they equal a fresh simulation. */
    free(s->start), free(s->end);
    s->start = malloc(n * sizeof(double));
    s->end = malloc(n * sizeof(double));
    if (!s->start || !s->end) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for %d times", total);
    for (int r = 0, j = 0; r < l->p; r++)
      for (int i = 0; i < l->count[r]; i++, j++) s->start[j] = l->t0[r][i], s->end[j] = l->t1[r][i];
    zb__schedule_fill_stats(s);
  }
  return ZB_OK;
}

/* ---- handle ----------------------------------------------------------------------------------- */

void zb__schedule_invalidate(zb_schedule_t *s) { s->simulated = 0; }

void zb__schedule_free(zb_schedule_t *s) {
  if (!s) return;
  free(s->tf);
  free(s->tb);
  free(s->tw);
  free(s->tbw);
  free(s->toff);
  free(s->trel);
  free(s->host_peak);
  free(s->disp_name);
  free(s->disp_unit);
  free(s->ops);
  free(s->rank_off);
  free(s->start);
  free(s->end);
  free(s->span);
  free(s->busy);
  free(s->peak);
  free(s->stage_map);
  free(s->stage_chunk);
  free(s->stage_unit);
  free(s);
}

/* Checks a caller's spec header and, for a caller built with the version 1 header (which ends
 * before the copy times) or the version 2 one (before Vocabulary Parallelism), points *spec at a
 * current copy without what its header lacked: callers built before those keep working. */
zb_status_t zb__upgrade_spec(const zb_schedule_spec_t **spec, zb_schedule_spec_t *upgraded) {
  const zb_schedule_spec_t *in = *spec;
  const size_t v1_size = offsetof(zb_schedule_spec_t, time_offload);
  const size_t v2_size = offsetof(zb_schedule_spec_t, vocab);
  if ((in->version == 1 && in->struct_size == v1_size) || (in->version == 2 && in->struct_size == v2_size)) {
    *upgraded = (zb_schedule_spec_t)ZB_SCHEDULE_SPEC_INIT;
    memcpy(upgraded, in, in->struct_size);
    upgraded->struct_size = sizeof(zb_schedule_spec_t), upgraded->version = ZB_SCHEDULE_SPEC_VERSION;
    *spec = upgraded;
    return ZB_OK;
  }
  if (in->struct_size < sizeof(zb_schedule_spec_t) || in->version != ZB_SCHEDULE_SPEC_VERSION)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "spec has struct_size %u and version %u; this library needs %zu and %d, %zu and 2, or "
                   "%zu and 1 (initialise it with ZB_SCHEDULE_SPEC_INIT)",
                   in->struct_size, in->version, sizeof(zb_schedule_spec_t), ZB_SCHEDULE_SPEC_VERSION, v2_size,
                   v1_size);
  return ZB_OK;
}

/* zb__schedule_alloc, naming the times of `named` (the caller's spec) when the total is too long:
 * alloc_mapped passes per-stage arrays of its own making, which the user never saw. */
static zb_status_t alloc_named(zb_schedule_t **out, const zb_schedule_spec_t *spec,
                               const zb_schedule_spec_t *named, int p, int v, int m,
                               zb_placement_t placement) {
  *out = NULL;
  ZB_CHECK(zb__spec_check_costs(spec, p * v));
  zb_schedule_t *s = calloc(1, sizeof *s);
  if (!s) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory allocating a schedule");
  s->kind = spec->kind;
  s->p = p;
  s->v = v;
  s->S = p * v;
  s->m = m;
  s->placement = placement;
  s->w_share = spec->w_share;
  s->mem_limit = spec->mem_limit > 0 ? spec->mem_limit : 0;
  s->t_comm = spec->time_comm;
  s->vocab = spec->vocab;
  s->ts = spec->time_s, s->tt = spec->time_t, s->tif = spec->time_if, s->tib = spec->time_ib;
  s->tvc = spec->time_vocab_comm;
  size_t S = (size_t)s->S;
  s->tf = malloc(S * sizeof(double));
  s->tb = malloc(S * sizeof(double));
  s->tw = malloc(S * sizeof(double));
  s->tbw = malloc(S * sizeof(double));
  s->toff = malloc(S * sizeof(double));
  s->trel = malloc(S * sizeof(double));
  s->rank_off = calloc((size_t)p + 1, sizeof(int));
  s->span = calloc((size_t)p, sizeof(double));
  s->busy = calloc((size_t)p, sizeof(double));
  s->peak = calloc((size_t)p, sizeof(double));
  s->host_peak = calloc((size_t)p, sizeof(double));
  if (!s->tf || !s->tb || !s->tw || !s->tbw || !s->toff || !s->trel || !s->rank_off || !s->span || !s->busy ||
      !s->peak || !s->host_peak) {
    zb__schedule_free(s);
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory allocating a schedule of %d stages", p * v);
  }
  for (size_t st = 0; st < S; st++) {
    /* Scalars are per rank (one microbatch through all of a rank's layers): a stage is 1/v of it. */
    s->tf[st] = spec->stage_time_f ? spec->stage_time_f[st] : spec->time_f / v;
    s->tb[st] = spec->stage_time_b ? spec->stage_time_b[st] : spec->time_b / v;
    s->tw[st] = spec->stage_time_w ? spec->stage_time_w[st] : spec->time_w / v;
    if (spec->stage_time_bw)
      s->tbw[st] = spec->stage_time_bw[st];
    else if (spec->time_bw > 0)
      s->tbw[st] = spec->time_bw / v;
    else
      s->tbw[st] = s->tb[st] + s->tw[st];
    s->toff[st] = spec->stage_time_offload ? spec->stage_time_offload[st] : spec->time_offload / v;
    s->trel[st] = spec->stage_time_reload ? spec->stage_time_reload[st] : spec->time_reload / v;
  }
  zb_status_t st = zb__schedule_check_total(s, named);
  if (st != ZB_OK) {
    zb__schedule_free(s);
    return st;
  }
  *out = s;
  return ZB_OK;
}

zb_status_t zb__schedule_alloc(zb_schedule_t **out, const zb_schedule_spec_t *spec, int p, int v,
                               int m, zb_placement_t placement) {
  return alloc_named(out, spec, spec, p, v, m, placement);
}

zb_status_t zb__schedule_alloc_mapped(zb_schedule_t **out, const zb_schedule_spec_t *spec, int p, int S,
                                      int m, const int32_t *map) {
  *out = NULL;
  int *count = calloc((size_t)p, sizeof(int));
  if (!count) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for a stage map of %d ranks", p);
  int v = 1;
  for (int st = 0; st < S; st++)
    if (++count[map[st]] > v) v = count[map[st]];
  /* Per-rank scalar times go to each rank's stages in equal parts: alloc divides by v, so give it
   * per-stage arrays made here. */
  zb_schedule_spec_t copy = *spec;
  double *t = malloc((size_t)S * 6 * sizeof(double));
  zb_status_t st = ZB_OK;
  if (!t) st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for %d stages", S);
  if (st == ZB_OK) {
    for (int k = 0; k < S; k++) {
      double n = count[map[k]];
      t[k] = spec->stage_time_f ? spec->stage_time_f[k] : spec->time_f / n;
      t[S + k] = spec->stage_time_b ? spec->stage_time_b[k] : spec->time_b / n;
      t[2 * S + k] = spec->stage_time_w ? spec->stage_time_w[k] : spec->time_w / n;
      t[3 * S + k] = spec->stage_time_bw ? spec->stage_time_bw[k]
                     : spec->time_bw > 0 ? spec->time_bw / n
                                         : t[S + k] + t[2 * S + k];
      t[4 * S + k] = spec->stage_time_offload ? spec->stage_time_offload[k] : spec->time_offload / n;
      t[5 * S + k] = spec->stage_time_reload ? spec->stage_time_reload[k] : spec->time_reload / n;
    }
    copy.stage_time_f = t, copy.stage_time_b = t + S, copy.stage_time_w = t + 2 * S;
    copy.stage_time_bw = t + 3 * S;
    copy.stage_time_offload = t + 4 * S, copy.stage_time_reload = t + 5 * S;
    /* alloc sizes the stage arrays by p * v: as one rank with S chunks they are S long, and the
     * per-stage times above are read as given; the per-rank arrays and the shape are set below. */
    st = alloc_named(out, &copy, spec, 1, S, m, ZB_PLACEMENT_CUSTOM);
  }
  free(t);
  zb_schedule_t *s = *out;
  if (st == ZB_OK) {
    free(s->rank_off), free(s->span), free(s->busy), free(s->peak), free(s->host_peak);
    s->rank_off = calloc((size_t)p + 1, sizeof(int));
    s->span = calloc((size_t)p, sizeof(double));
    s->busy = calloc((size_t)p, sizeof(double));
    s->peak = calloc((size_t)p, sizeof(double));
    s->host_peak = calloc((size_t)p, sizeof(double));
    s->stage_map = malloc((size_t)S * sizeof(int32_t));
    s->stage_chunk = malloc((size_t)S * sizeof(int));
    s->stage_unit = malloc((size_t)S * sizeof(double));
    if (!s->rank_off || !s->span || !s->busy || !s->peak || !s->host_peak || !s->stage_map || !s->stage_chunk ||
        !s->stage_unit)
      st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory allocating a schedule of %d stages", S);
  }
  if (st == ZB_OK) {
    s->p = p, s->v = v, s->S = S;
    memset(count, 0, (size_t)p * sizeof(int));
    for (int k = 0; k < S; k++) {
      s->stage_map[k] = map[k];
      s->stage_chunk[k] = count[map[k]]++;
    }
    for (int k = 0; k < S; k++) s->stage_unit[k] = 1.0 / count[map[k]];
  } else if (s) {
    zb__schedule_free(s);
    *out = NULL;
  }
  free(count);
  return st;
}

zb_status_t zb__schedule_clone_shape(const zb_schedule_t *s, int m, zb_schedule_t **out) {
  zb_schedule_spec_t spec = ZB_SCHEDULE_SPEC_INIT;
  spec.kind = s->kind;
  spec.stage_time_f = s->tf;
  spec.stage_time_b = s->tb;
  spec.stage_time_w = s->tw;
  spec.stage_time_bw = s->tbw;
  spec.stage_time_offload = s->toff;
  spec.stage_time_reload = s->trel;
  spec.time_comm = s->t_comm;
  spec.w_share = s->w_share;
  spec.mem_limit = s->mem_limit;
  spec.vocab = s->vocab;
  spec.time_s = s->ts, spec.time_t = s->tt, spec.time_if = s->tif, spec.time_ib = s->tib;
  spec.time_vocab_comm = s->tvc;
  if (s->stage_map) return zb__schedule_alloc_mapped(out, &spec, s->p, s->S, m, s->stage_map);
  return zb__schedule_alloc(out, &spec, s->p, s->v, m, s->placement);
}

zb_status_t zb__schedule_clone_empty(const zb_schedule_t *s, zb_schedule_t **out) {
  return zb__schedule_clone_shape(s, s->m, out);
}

void zb__schedule_take(zb_schedule_t *s, zb_schedule_t *from) {
  free(s->ops);
  free(s->rank_off);
  s->ops = from->ops, s->rank_off = from->rank_off, s->n_ops = from->n_ops;
  from->ops = NULL, from->rank_off = NULL, from->n_ops = 0;
  zb__schedule_invalidate(s);
  if (from->simulated) { /* its times too: the searched generators time as they go */
    double *t0 = s->start, *t1 = s->end;
    s->start = from->start, s->end = from->end;
    from->start = t0, from->end = t1;
    zb__schedule_fill_stats(s);
  }
  zb__schedule_invalidate(from);
}

/* The chunks a kind uses when the spec says 0, and whether it accepts a given v. */
static int default_chunks(zb_kind_t kind) {
  switch (kind) {
    case ZB_KIND_INTERLEAVED_1F1B:
    case ZB_KIND_GROUP_INTERLEAVED_1F1B:
    case ZB_KIND_ZB_V:
    case ZB_KIND_V_HALF:
    case ZB_KIND_V_MIN: return 2;
    default: return 1;
  }
}

static zb_status_t check_shape(const zb_schedule_spec_t *spec, int v) {
  const char *name = zb_kind_name(spec->kind);
  int p = spec->ranks, m = spec->microbatches;
  if (p < 1) return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "ranks (p) is %d; it must be >= 1", p);
  if (m < 1) return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "microbatches (m) is %d; it must be >= 1", m);
  if (v < 1) return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "chunks (v) is %d; it must be >= 1", v);
  /* Keep every index and op count comfortably inside int. */
  if ((long long)p * v > 65536 || m > 1 << 20 || (long long)p * v * m * 3 > 200000000LL)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "p=%d, v=%d, m=%d is too large; at most 65536 stages and 2e8 ops", p, v, m);
  switch (spec->kind) {
    case ZB_KIND_GPIPE:
    case ZB_KIND_1F1B:
    case ZB_KIND_ZB_H1:
    case ZB_KIND_ZB_H2:
      if (v != 1)
        return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                       "%s uses one chunk per rank (v = 1), got v = %d; use interleaved-1f1b or a "
                       "V kind for more chunks",
                       name, v);
      break;
    case ZB_KIND_INTERLEAVED_1F1B: {
      /* torch's rule (ScheduleInterleaved1F1B): max(1, m / p) rounds of equal size, so m must be a
       * multiple of the round count; any v >= 1 (v = 1 is 1F1B with torch's deeper warm-up). */
      int rounds = m / p > 1 ? m / p : 1;
      if (m % rounds != 0) {
        int lo = m - 1, hi = m + 1;
        while (lo > 0 && lo % (lo / p > 1 ? lo / p : 1) != 0) lo--;
        while (hi % (hi / p > 1 ? hi / p : 1) != 0) hi++;
        char near[64];
        if (lo < 1 || hi - m < m - lo) snprintf(near, sizeof near, "%d", hi);
        else if (m - lo < hi - m) snprintf(near, sizeof near, "%d", lo);
        else snprintf(near, sizeof near, "%d or %d", lo, hi);
        return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                       "interleaved-1f1b splits m = %d into max(1, m / p) = %d rounds of equal size, as "
                       "torch does, so m must be a multiple of %d with p = %d (nearest valid: %s)",
                       m, rounds, rounds, p, near);
      }
      break;
    }
    case ZB_KIND_ZB_V:
    case ZB_KIND_V_HALF:
    case ZB_KIND_V_MIN:
      if (v != 2)
        return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                       "%s places two chunks per rank in a V (v = 2), got v = %d", name, v);
      break;
    case ZB_KIND_GROUP_INTERLEAVED_1F1B:
      break; /* any v >= 1 and m >= 1 (groups beyond m are cut, as the reference cuts them) */
    case ZB_KIND_ZB_AUTO:
      if (spec->placement_set && spec->placement == ZB_PLACEMENT_LOOP) break; /* any v >= 1 */
      if (spec->placement_set && spec->placement == ZB_PLACEMENT_V && v != 2)
        return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "zb-auto in a V places v = 2 chunks per rank, got v = %d", v);
      if (v != 1 && v != 2)
        return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                       "zb-auto schedules v = 1 (loop placement) or v = 2 (V placement) by default, got "
                       "v = %d; set placement to loop (placement_set = 1) for %d loop-placed stages per rank",
                       v, v);
      break;
    default:
      return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                     "kind %d cannot be generated; valid kinds: gpipe, 1f1b, interleaved-1f1b, "
                     "zb-h1, zb-h2, zb-v, v-half, v-min, zb-auto, group-interleaved-1f1b",
                     (int)spec->kind);
  }
  return ZB_OK;
}

/* V-Min is a memory budget as much as a pattern: V-Half's order replaces its own where it needs no
 * more memory and steps shorter (at p = 5, m = 20 on the paper's 1.5B costs both reach 3
 * microbatches, and v-min's pattern takes 1215.6 where v-half's takes 1057.2; a CP-SAT solver found
 * v-min's patterns 5% above the optimum on average). The kind stays v-min. zb_schedule_refine's
 * swaps go further, for ~100 ms. */
static zb_status_t best_under_own_memory(zb_schedule_t *s) {
  zb_sim_result_t r, rc;
  ZB_CHECK(zb_schedule_simulate(s, &r));
  const double step = zb__makespan_of(s, s->start, s->end);
  zb_schedule_t *c = NULL;
  ZB_CHECK(zb__schedule_clone_empty(s, &c));
  zb_status_t st = zb__gen_v_half(c);
  if (st == ZB_OK) st = zb_schedule_simulate(c, &rc);
  if (st == ZB_OK && rc.max_peak_memory <= r.max_peak_memory + ZB_EPS &&
      zb__makespan_of(c, c->start, c->end) < step - ZB_EPS * fmax(1.0, step))
    zb__schedule_take(s, c);
  zb__schedule_free(c);
  if (st == ZB_ERR_INFEASIBLE) { /* no v-half at this size: v-min's own order stays */
    zb__clear_error();
    st = ZB_OK;
  }
  return st;
}

zb_status_t zb_schedule_create(zb_schedule_t **out, const zb_schedule_spec_t *spec) {
  ZB_ARG_NOT_NULL(out);
  *out = NULL;
  ZB_ARG_NOT_NULL(spec);
  zb_schedule_spec_t upgraded;
  ZB_CHECK(zb__upgrade_spec(&spec, &upgraded));
  int v = spec->chunks ? spec->chunks : default_chunks(spec->kind);
  ZB_CHECK(check_shape(spec, v));
  zb_placement_t placement = ZB_PLACEMENT_LOOP;
  if (spec->kind == ZB_KIND_ZB_V || spec->kind == ZB_KIND_V_HALF || spec->kind == ZB_KIND_V_MIN ||
      (spec->kind == ZB_KIND_ZB_AUTO && v == 2))
    placement = ZB_PLACEMENT_V;
  if (spec->placement_set) {
    if (spec->placement != ZB_PLACEMENT_LOOP && spec->placement != ZB_PLACEMENT_V)
      return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "spec placement is %d; it is ZB_PLACEMENT_LOOP (0) or ZB_PLACEMENT_V (1)",
                     (int)spec->placement);
    if (spec->kind != ZB_KIND_ZB_AUTO && spec->placement != placement)
      return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "%s places stages in a %s; only zb-auto takes either placement",
                     zb_kind_name(spec->kind), placement == ZB_PLACEMENT_V ? "V" : "loop");
    placement = spec->placement;
  }
  zb_schedule_t *s = NULL;
  ZB_CHECK(zb__schedule_alloc(&s, spec, spec->ranks, v, spec->microbatches, placement));
  zb_status_t st = ZB_OK;
  if (spec->vocab && spec->kind == ZB_KIND_1F1B) {
    st = zb__gen_vocab_1f1b(s);
    if (st != ZB_OK) {
      zb__schedule_free(s);
      return st;
    }
    zb__schedule_invalidate(s);
    *out = s;
    return ZB_OK;
  }
  const int vocab = s->vocab;
  s->vocab = 0; /* the kind's order first (its generator may simulate it); the passes go in after */
  switch (spec->kind) {
    case ZB_KIND_GPIPE: st = zb__gen_gpipe(s); break;
    case ZB_KIND_1F1B: st = zb__gen_1f1b(s); break;
    case ZB_KIND_INTERLEAVED_1F1B: st = zb__gen_interleaved(s); break;
    case ZB_KIND_ZB_H1: st = zb__gen_zb_h1(s); break;
    case ZB_KIND_ZB_H2: st = zb__gen_zb_h2(s); break;
    case ZB_KIND_ZB_V: st = zb__gen_zb_v(s); break;
    case ZB_KIND_V_HALF: st = zb__gen_v_half(s); break;
    case ZB_KIND_V_MIN: st = zb__gen_v_min(s); break;
    case ZB_KIND_ZB_AUTO: st = zb__gen_auto(s, s->mem_limit); break;
    case ZB_KIND_GROUP_INTERLEAVED_1F1B: st = zb__gen_gis(s); break;
    default: st = ZB_FAIL(ZB_ERR_INTERNAL, "no generator for kind %d", (int)spec->kind);
  }
  if (st == ZB_OK && spec->kind == ZB_KIND_V_MIN) st = best_under_own_memory(s);
  s->vocab = vocab;
  if (st == ZB_OK && vocab) st = zb__place_vocab(s);
  if (st == ZB_OK && vocab) st = spec->kind == ZB_KIND_V_HALF ? zb__vocab_wider_v(s) : zb__vocab_search(s);
  if (st != ZB_OK) {
    zb__schedule_free(s);
    return st;
  }
  /* Generators that time as they go leave their times behind; the API promises a schedule that is
   * simulated when the caller asks for it (zb_schedule_simulate), so start from that state. */
  zb__schedule_invalidate(s);
  *out = s;
  return ZB_OK;
}

/* Copies the callers' op lists into s (freed on failure). */
static zb_status_t copy_ops(zb_schedule_t *s, const zb_op_t *const *rank_ops, const int32_t *rank_counts) {
  int p = s->p;
  long long total = 0;
  for (int r = 0; r < p; r++) {
    if (rank_counts[r] < 0 || (rank_counts[r] > 0 && !rank_ops[r]))
      return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "rank %d: count %d with ops %p", r, (int)rank_counts[r],
                     (const void *)rank_ops[r]);
    total += rank_counts[r];
  }
  if (total > 200000000LL) return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "%lld ops; at most 2e8", total);
  s->ops = malloc((size_t)(total ? total : 1) * sizeof(zb_op_t));
  if (!s->ops) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for %lld ops", total);
  int k = 0;
  for (int r = 0; r < p; r++) {
    s->rank_off[r] = k;
    if (rank_counts[r]) memcpy(s->ops + k, rank_ops[r], (size_t)rank_counts[r] * sizeof(zb_op_t));
    k += rank_counts[r];
  }
  s->rank_off[p] = k;
  s->n_ops = k;
  return ZB_OK;
}

zb_status_t zb_schedule_create_from_ops(zb_schedule_t **out, const zb_schedule_spec_t *spec,
                                        zb_placement_t placement, const zb_op_t *const *rank_ops,
                                        const int32_t *rank_counts) {
  ZB_ARG_NOT_NULL(out);
  *out = NULL;
  ZB_ARG_NOT_NULL(spec);
  ZB_ARG_NOT_NULL(rank_ops);
  ZB_ARG_NOT_NULL(rank_counts);
  zb_schedule_spec_t upgraded;
  ZB_CHECK(zb__upgrade_spec(&spec, &upgraded));
  int p = spec->ranks, v = spec->chunks ? spec->chunks : 1, m = spec->microbatches;
  if (p < 1 || v < 1 || m < 1)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "p=%d, v=%d, m=%d; each must be >= 1", p, v, m);
  if ((long long)p * v > 65536)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "p*v = %lld stages; at most 65536", (long long)p * v);
  if (placement != ZB_PLACEMENT_LOOP && placement != ZB_PLACEMENT_V)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "placement %d; use ZB_PLACEMENT_LOOP or ZB_PLACEMENT_V (an explicit map: "
                   "zb_schedule_create_from_ops_mapped)",
                   (int)placement);
  if (placement == ZB_PLACEMENT_V && v != 2)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "V placement needs v = 2 chunks, got v = %d", v);
  zb_schedule_spec_t copy = *spec;
  copy.kind = ZB_KIND_CUSTOM;
  zb_schedule_t *s = NULL;
  ZB_CHECK(zb__schedule_alloc(&s, &copy, p, v, m, placement));
  zb_status_t st = copy_ops(s, rank_ops, rank_counts);
  if (st != ZB_OK) {
    zb__schedule_free(s);
    return st;
  }
  *out = s;
  return ZB_OK;
}

/* The placement a map is, when it is one of the named ones (S = p*v stages in a loop, or the V). */
static int map_is(const int32_t *map, int p, int S, zb_placement_t placement) {
  if (placement == ZB_PLACEMENT_V && S != 2 * p) return 0;
  if (placement == ZB_PLACEMENT_LOOP && S % p != 0) return 0;
  for (int st = 0; st < S; st++) {
    int want = placement == ZB_PLACEMENT_V ? (st < p ? st : 2 * p - 1 - st) : st % p;
    if (map[st] != want) return 0;
  }
  return 1;
}

zb_status_t zb_schedule_create_from_ops_mapped(zb_schedule_t **out, const zb_schedule_spec_t *spec,
                                               const int32_t *stage_ranks, int32_t num_stages,
                                               const zb_op_t *const *rank_ops, const int32_t *rank_counts) {
  ZB_ARG_NOT_NULL(out);
  *out = NULL;
  ZB_ARG_NOT_NULL(spec);
  ZB_ARG_NOT_NULL(stage_ranks);
  ZB_ARG_NOT_NULL(rank_ops);
  ZB_ARG_NOT_NULL(rank_counts);
  zb_schedule_spec_t upgraded;
  ZB_CHECK(zb__upgrade_spec(&spec, &upgraded));
  int p = spec->ranks, S = num_stages, m = spec->microbatches;
  if (p < 1 || S < 1 || m < 1)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "p=%d, stages=%d, m=%d; each must be >= 1", p, S, m);
  if (S > 65536) return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "%d stages; at most 65536", S);
  if (S < p)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "%d stages over %d ranks; every rank must hold a stage", S, p);
  for (int st = 0; st < S; st++)
    if (stage_ranks[st] < 0 || stage_ranks[st] >= p)
      return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "stage %d is mapped to rank %d; ranks are 0..%d", st,
                     (int)stage_ranks[st], p - 1);
  zb_schedule_spec_t copy = *spec;
  copy.kind = ZB_KIND_CUSTOM;
  zb_schedule_t *s = NULL;
  zb_status_t st = ZB_OK;
  if (map_is(stage_ranks, p, S, ZB_PLACEMENT_V) && p > 1) {
    st = zb__schedule_alloc(&s, &copy, p, 2, m, ZB_PLACEMENT_V);
  } else if (map_is(stage_ranks, p, S, ZB_PLACEMENT_LOOP)) {
    st = zb__schedule_alloc(&s, &copy, p, S / p, m, ZB_PLACEMENT_LOOP);
  } else {
    int *holds = calloc((size_t)p, sizeof(int));
    if (!holds) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for %d ranks", p);
    for (int k = 0; k < S; k++) holds[stage_ranks[k]] = 1;
    int empty = -1;
    for (int r = 0; r < p && empty < 0; r++)
      if (!holds[r]) empty = r;
    free(holds);
    if (empty >= 0)
      return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "the stage map puts no stage on rank %d; every rank must hold one",
                     empty);
    ZB_CHECK(zb__spec_check_costs(spec, S));
    st = zb__schedule_alloc_mapped(&s, &copy, p, S, m, stage_ranks);
  }
  if (st == ZB_OK) st = copy_ops(s, rank_ops, rank_counts);
  if (st != ZB_OK) {
    zb__schedule_free(s);
    return st;
  }
  *out = s;
  return ZB_OK;
}

zb_status_t zb_schedule_destroy(zb_schedule_t *schedule) {
  zb__schedule_free(schedule);
  return ZB_OK;
}

zb_status_t zb_schedule_get_info(const zb_schedule_t *s, zb_schedule_info_t *out) {
  ZB_ARG_NOT_NULL(s);
  ZB_ARG_NOT_NULL(out);
  out->kind = s->kind;
  out->ranks = s->p;
  out->chunks = s->v;
  out->stages = s->S;
  out->microbatches = s->m;
  out->placement = s->placement;
  out->w_share = s->w_share;
  out->mem_limit = s->mem_limit;
  out->time_comm = s->t_comm;
  return ZB_OK;
}

zb_status_t zb_schedule_rank_ops(const zb_schedule_t *s, int32_t rank, const zb_op_t **ops,
                                 int32_t *count) {
  ZB_ARG_NOT_NULL(s);
  ZB_ARG_NOT_NULL(ops);
  ZB_ARG_NOT_NULL(count);
  if (rank < 0 || rank >= s->p)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "rank %d is out of range; the schedule has ranks 0..%d",
                   (int)rank, s->p - 1);
  *ops = s->ops + s->rank_off[rank];
  *count = s->rank_off[rank + 1] - s->rank_off[rank];
  return ZB_OK;
}

zb_status_t zb_schedule_stage_rank(const zb_schedule_t *s, int32_t stage, int32_t *rank) {
  ZB_ARG_NOT_NULL(s);
  ZB_ARG_NOT_NULL(rank);
  if (stage < 0 || stage >= s->S)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "stage %d is out of range; the schedule has stages 0..%d",
                   (int)stage, s->S - 1);
  *rank = zb__stage_rank(s, stage);
  return ZB_OK;
}

zb_status_t zb_schedule_op_time(const zb_schedule_t *s, zb_op_type_t type, int32_t stage,
                                double *out) {
  ZB_ARG_NOT_NULL(s);
  ZB_ARG_NOT_NULL(out);
  if (type < ZB_OP_F || type > ZB_OP_IB)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "op type %d; use ZB_OP_F, ZB_OP_B, ZB_OP_W, ZB_OP_BW, ZB_OP_OFFLOAD, ZB_OP_RELOAD, ZB_OP_S, "
                   "ZB_OP_T, ZB_OP_IF or ZB_OP_IB", (int)type);
  if (zb__op_is_vocab(type) ? (stage < 0 || stage >= s->p) : (stage < 0 || stage >= s->S))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "%s %d is out of range; the schedule has %s 0..%d",
                   zb__op_is_vocab(type) ? "rank" : "stage", (int)stage,
                   zb__op_is_vocab(type) ? "ranks" : "stages", zb__op_is_vocab(type) ? s->p - 1 : s->S - 1);
  *out = zb__op_cost(s, type, stage);
  return ZB_OK;
}

zb_status_t zb_format_from_name(const char *name, zb_format_t *out) {
  ZB_ARG_NOT_NULL(name);
  ZB_ARG_NOT_NULL(out);
  static const char *names[] = {"text", "csv", "json", "chrome", "svg", "csv-comms"};
  for (int i = 0; i < 6; i++)
    if (strcmp(name, names[i]) == 0) {
      *out = (zb_format_t)i;
      return ZB_OK;
    }
  return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                 "unknown format '%s'; valid formats: text, csv, json, chrome, svg, csv-comms", name);
}

zb_status_t zb_schedule_export(zb_schedule_t *s, zb_format_t format, char **out, size_t *len) {
  ZB_ARG_NOT_NULL(s);
  ZB_ARG_NOT_NULL(out);
  *out = NULL;
  if (len) *len = 0;
  size_t dummy = 0;
  if (!len) len = &dummy;
  if (format != ZB_FORMAT_CSV && !s->simulated) {
    zb_sim_result_t r;
    ZB_CHECK(zb_schedule_simulate(s, &r));
  }
  switch (format) {
    case ZB_FORMAT_TEXT: return zb__export_text(s, out, len);
    case ZB_FORMAT_CSV: return zb__export_csv(s, out, len);
    case ZB_FORMAT_JSON: return zb__export_json(s, out, len);
    case ZB_FORMAT_CHROME: return zb__export_chrome(s, out, len);
    case ZB_FORMAT_SVG: return zb__export_svg(s, out, len);
    case ZB_FORMAT_CSV_COMMS: return zb__export_csv_comms(s, out, len);
  }
  return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                 "unknown format %d; valid formats: text, csv, json, chrome, svg, csv-comms", (int)format);
}

zb_status_t zb_schedule_import(zb_schedule_t **out, zb_format_t format, const char *text, size_t len,
                               const zb_schedule_spec_t *spec) {
  ZB_ARG_NOT_NULL(out);
  *out = NULL;
  if (!text && len) ZB_ARG_NOT_NULL(text);
  zb_schedule_spec_t defaults = ZB_SCHEDULE_SPEC_INIT;
  if (!spec) spec = &defaults;
  zb_schedule_spec_t upgraded;
  ZB_CHECK(zb__upgrade_spec(&spec, &upgraded));
  if (format != ZB_FORMAT_CSV)
    return ZB_FAIL(ZB_ERR_UNSUPPORTED, "import reads CSV only (format %d given)", (int)format);
  return zb__import_csv(out, text ? text : "", len, spec);
}

zb_status_t zb_schedule_refine(zb_schedule_t **out, const zb_schedule_t *schedule, double device_limit) {
  ZB_ARG_NOT_NULL(out);
  *out = NULL;
  ZB_ARG_NOT_NULL(schedule);
  if (isnan(device_limit) || isinf(device_limit))
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "zb_schedule_refine: device_limit is %g; a number of microbatches "
                   "(<= 0: the schedule's own largest peak)", device_limit);
  for (int k = 0; k < schedule->n_ops; k++) {
    if (zb__op_is_copy(schedule->ops[k].type))
      return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "zb_schedule_refine: the schedule has copies (%s stage %d mb %d); "
                     "refine it before the offload pass", zb__op_name(schedule->ops[k].type), schedule->ops[k].stage,
                     schedule->ops[k].mb);
  }
  ZB_CHECK(zb__validate_structure(schedule));
  zb_schedule_t *t = NULL;
  ZB_CHECK(zb__schedule_clone_empty(schedule, &t));
  t->kind = schedule->kind;
  zb_status_t st = ZB_OK;
  t->ops = malloc((size_t)(schedule->n_ops ? schedule->n_ops : 1) * sizeof(zb_op_t));
  if (!t->ops) st = ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory copying %d ops", schedule->n_ops);
  if (st == ZB_OK) {
    memcpy(t->ops, schedule->ops, (size_t)schedule->n_ops * sizeof(zb_op_t));
    memcpy(t->rank_off, schedule->rank_off, ((size_t)schedule->p + 1) * sizeof(int));
    t->n_ops = schedule->n_ops;
    if (!(device_limit > 0)) {
      zb_sim_result_t r;
      st = zb_schedule_simulate(t, &r);
      device_limit = r.max_peak_memory;
    }
  }
  if (st == ZB_OK) st = zb__local_search(t, device_limit, ZB_REFINE_WORK);
  if (st != ZB_OK) {
    zb__schedule_free(t);
    return st;
  }
  *out = t;
  return ZB_OK;
}
