/*
 * internal.h - the schedule handle's layout and the helpers shared by generators, the validator,
 * the simulator and the import/export code. Private to csrc/schedule/.
 *
 * A schedule is p op lists stored back to back in one array: rank r's ops are
 * ops[rank_off[r] .. rank_off[r+1]). Per-stage times are absolute (already divided by v).
 */
#ifndef ZB_SCHEDULE_INTERNAL_H
#define ZB_SCHEDULE_INTERNAL_H

#include <stddef.h>

#include "../common/error.h"
#include "zbpp.h"

struct zb_schedule {
  zb_kind_t kind;
  int p, v, S, m;
  zb_placement_t placement;
  /* ZB_PLACEMENT_CUSTOM only (NULL otherwise): stage -> rank, and stage -> its index among its
   * rank's stages (S each). v is then the most stages any rank holds. */
  int32_t *stage_map;
  int *stage_chunk;
  double *stage_unit; /* 1 / (stages its rank holds): its share of a microbatch's memory */
  double w_share;
  double mem_limit; /* <= 0: none */
  double t_comm;
  double *tf, *tb, *tw, *tbw; /* S each */
  double *toff, *trel;        /* S each: OFFLOAD and RELOAD copy times */
  /* Vocabulary Parallelism (spec version 3): 0 none, 1 two barriers, 2 one (zbpp.h, ZB_OP_S); one
   * rank's S, T, IF and IB pass, and a barrier's all-reduces. */
  int vocab;
  double ts, tt, tif, tib, tvc;

  zb_op_t *ops;  /* all ranks' ops, rank by rank */
  int *rank_off; /* p + 1 offsets into ops */
  int n_ops;

  /* Simulation results; valid while `simulated` is set. Any change to ops clears it. */
  int simulated;
  double *start, *end; /* aligned with ops */
  double *span, *busy, *peak; /* p each */
  double *host_peak;          /* p each: activations held in host memory by OFFLOADs */
  zb_sim_result_t sim;

  /* zb_schedule_set_display: the exports' title and time unit (NULL: the kind's name, none named)
   * and the svg's drawn time span (0: the makespan). */
  char *disp_name, *disp_unit;
  double disp_span;
};

/* The step's makespan (first compute op's start to last one's end, any rank) and idle share of all
 * ranks' time over it, from the current times (zb_schedule_step_idle). */
void zb__step_idle(const zb_schedule_t *s, double *makespan, double *idle_rate);
/* The name exports give the schedule: the display name, else the kind's. */
const char *zb__display_name(const zb_schedule_t *s);

/* Growable per-rank op lists used while generating; turned into the handle's flat array at the end. */
typedef struct {
  int p;
  zb_op_t **list;
  double **t0, **t1; /* per op: start and end, when the generator timed it */
  int *count, *cap;
  int untimed; /* some op was pushed without its times */
} zb__oplists_t;

zb_status_t zb__oplists_init(zb__oplists_t *l, int p);
zb_status_t zb__oplists_push(zb__oplists_t *l, int rank, int type, int stage, int mb);
/* The same with the op's simulated start and end: when every op of the lists was pushed this way,
 * zb__schedule_take_ops keeps the times as the schedule's simulation instead of running it again. */
zb_status_t zb__oplists_push_timed(zb__oplists_t *l, int rank, int type, int stage, int mb,
                                   double start, double end);
void zb__oplists_free(zb__oplists_t *l);
/* Moves the lists into s->ops/rank_off (the lists are left empty but still need zb__oplists_free);
 * with every op timed, also the times as s's simulation results. */
zb_status_t zb__schedule_take_ops(zb_schedule_t *s, zb__oplists_t *l);

/* Checks a caller's spec header; a caller built with an older header (version 1 or 2, shorter)
 * gets *spec pointed at `upgraded`, a current copy without what its header lacked (schedule.c). */
zb_status_t zb__upgrade_spec(const zb_schedule_spec_t **spec, zb_schedule_spec_t *upgraded);

/* Checks the cost part of a spec with S stages (spec_costs.c): finite times >= 0, w_share in
 * [0, 1], a finite mem_limit. Shared by create, create_from_ops and import. */
zb_status_t zb__spec_check_costs(const zb_schedule_spec_t *spec, int S);
/* Refuses costs whose schedule could not have a finite length: m times the work of every stage
 * plus every hop's time_comm must stay at most a limit far below DBL_MAX (spec_costs.c says why).
 * The message names the largest input of `named`, the spec the caller gave. */
zb_status_t zb__schedule_check_total(const zb_schedule_t *s, const zb_schedule_spec_t *named);
/* Allocates a handle with p, v, m, placement and costs filled from spec (kind-independent parts).
 * spec times are per rank (divided by v here); stage arrays are absolute. Runs both checks above. */
zb_status_t zb__schedule_alloc(zb_schedule_t **out, const zb_schedule_spec_t *spec, int p, int v,
                               int m, zb_placement_t placement);
/* The same over an explicit map of S stages to ranks (ZB_PLACEMENT_CUSTOM; map is copied): per-rank
 * spec times are divided among each rank's stages. The caller has checked the map. */
zb_status_t zb__schedule_alloc_mapped(zb_schedule_t **out, const zb_schedule_spec_t *spec, int p, int S,
                                      int m, const int32_t *map);
/* A new handle with the same shape, costs and limit as s but no ops (for trying candidates). */
zb_status_t zb__schedule_clone_empty(const zb_schedule_t *s, zb_schedule_t **out);
/* The same with m microbatches instead of s->m (zb-auto ranks its rule sets on a shorter copy). */
zb_status_t zb__schedule_clone_shape(const zb_schedule_t *s, int m, zb_schedule_t **out);
/* Moves `from`'s op lists (and its simulated times, if it has them) into s, which must have the
 * same shape; `from` is left without ops, to be freed. */
void zb__schedule_take(zb_schedule_t *s, zb_schedule_t *from);
/* Frees everything; the same as zb_schedule_destroy without the public checks. */
void zb__schedule_free(zb_schedule_t *s);
/* Drops cached simulation results (after the ops changed). */
void zb__schedule_invalidate(zb_schedule_t *s);

static inline const char *zb__placement_name(zb_placement_t p) {
  return p == ZB_PLACEMENT_V ? "v" : p == ZB_PLACEMENT_CUSTOM ? "custom" : "loop";
}

/* Stage -> rank and stage -> chunk under a placement. */
static inline int zb__stage_rank(const zb_schedule_t *s, int stage) {
  if (s->stage_map) return s->stage_map[stage];
  if (s->placement == ZB_PLACEMENT_V) return stage < s->p ? stage : 2 * s->p - 1 - stage;
  return stage % s->p;
}
static inline int zb__stage_chunk(const zb_schedule_t *s, int stage) {
  return s->stage_chunk ? s->stage_chunk[stage] : stage / s->p;
}

static inline double zb__op_cost(const zb_schedule_t *s, int type, int stage) {
  switch (type) {
    case ZB_OP_F: return s->tf[stage];
    case ZB_OP_B: return s->tb[stage];
    case ZB_OP_W: return s->tw[stage];
    case ZB_OP_OFFLOAD: return s->toff[stage];
    case ZB_OP_RELOAD: return s->trel[stage];
    case ZB_OP_S: return s->ts;
    case ZB_OP_T: return s->tt;
    case ZB_OP_IF: return s->tif;
    case ZB_OP_IB: return s->tib;
    default: return s->tbw[stage];
  }
}

/* OFFLOAD and RELOAD run on a rank's copy lane, not its compute. */
static inline int zb__op_is_copy(int type) { return type == ZB_OP_OFFLOAD || type == ZB_OP_RELOAD; }

/* Vocabulary Parallelism's passes run on a rank's compute but belong to no stage: op->stage holds
 * the rank (zbpp.h). Code that indexes by stage skips them. */
static inline int zb__op_is_vocab(int type) { return type >= ZB_OP_S && type <= ZB_OP_IB; }

/* Device memory change of one op in units of a microbatch through all of a rank's layers
 * (DESIGN.md 3): what it leaves resident once done, in list order. A copy moves memory between the
 * device and the host and leaves the device's total after its RELOAD as it was before its OFFLOAD,
 * so in list order it counts 0; the simulator counts both in time (simulate.c). */
static inline double zb__op_mem(const zb_schedule_t *s, int type) {
  double unit = 1.0 / s->v;
  switch (type) {
    case ZB_OP_F: return unit;
    case ZB_OP_B: return -(1.0 - s->w_share) * unit;
    case ZB_OP_W: return -s->w_share * unit;
    case ZB_OP_OFFLOAD:
    case ZB_OP_RELOAD:
    case ZB_OP_S: /* a vocabulary pass keeps per-token statistics, not counted (DESIGN.md 3) */
    case ZB_OP_T:
    case ZB_OP_IF:
    case ZB_OP_IB: return 0.0;
    default: return -unit;
  }
}

/* The same for an op of a given stage: under an explicit map a rank's unit is 1/(its own stage
 * count), as its per-rank times are divided (zb__schedule_alloc_mapped). */
static inline double zb__op_mem_at(const zb_schedule_t *s, int type, int stage) {
  double mem = zb__op_mem(s, type);
  if (zb__op_is_vocab(type)) return 0.0;
  return s->stage_unit ? mem * s->v * s->stage_unit[stage] : mem;
}

/* Name of an op type in messages and JSON: F, B, W, "BW", "OFFLOAD" and "RELOAD" (CSV uses torch's
 * letters for the first four instead). */
const char *zb__op_name(int type);

/* Tolerance for comparing simulated times and memory (sums of a few thousand doubles). */
#define ZB_EPS 1e-9

/* The simulator core: fills start/end (aligned with s->ops) for the given op order, or reports the
 * first stuck position of each rank. Used by zb_schedule_simulate and by the validator's deadlock
 * rule. Returns ZB_ERR_INVALID_SCHEDULE with a message when the ops cannot all run. */
zb_status_t zb__simulate_times(const zb_schedule_t *s, double *start, double *end);
/* The same with each op's duration from dur (aligned with s->ops) instead of the stage costs. */
zb_status_t zb__simulate_durations(const zb_schedule_t *s, const double *dur, double *start, double *end);

/* Rank r's device-resident and host memory peaks for op times aligned with s->ops, in time over
 * both lanes where the rank has copies (list order otherwise), and the index into s->ops of the op
 * at which device memory first exceeds `limit` (> 0; else -1) with the memory then. */
/* One change of a rank's activation memory (the model of DESIGN.md section 3 in time): an F holds
 * its share from its start, B, W, BW and the vocabulary passes change it at their end, an OFFLOAD
 * moves it to the host (host = 1) and a RELOAD back. order: the op's index. */
typedef struct {
  double t, delta;
  int host, order;
} zb__mem_event_t;

/* Rank r's memory events in time order (frees first at one instant), malloc'd into *out (the
 * caller frees it); the simulator's count and the Chrome trace's counter both read them. */
zb_status_t zb__memory_events(const zb_schedule_t *s, int r, const double *start, const double *end,
                              zb__mem_event_t **out, int *count);
zb_status_t zb__rank_memory(const zb_schedule_t *s, int r, const double *start, const double *end, double limit,
                            double *dev_peak, double *host_peak, int *first_over, double *over_mem);
/* Span, busy and peak per rank and the overall figures from s->start/end (simulated or measured);
 * sets s->simulated. Spans run from a rank's earliest start to its latest end, over compute ops;
 * busy sums compute ops (copies run beside them). */
void zb__schedule_fill_stats(zb_schedule_t *s);

/* The validator's rules 1-4 (well-formed, complete, same-rank order, FIFO channels); the simulator
 * runs them first so its core can trust the ops. */
zb_status_t zb__validate_structure(const zb_schedule_t *s);

/* Generators: each fills s->ops for s->p, s->v, s->m (already checked to be ones the kind accepts).
 * `limit` is the memory limit they must respect where the kind takes one. */
zb_status_t zb__gen_gpipe(zb_schedule_t *s);
zb_status_t zb__gen_1f1b(zb_schedule_t *s);
/* 1F1B with Vocabulary Parallelism's passes (s->vocab 1 or 2): the reference's order (gen_vocab.c). */
zb_status_t zb__gen_vocab_1f1b(zb_schedule_t *s);
/* Vocabulary Parallelism's passes placed into s's order (s->vocab 1 or 2; simulate.c). */
zb_status_t zb__place_vocab(zb_schedule_t *s);
/* V-Half with the passes placed (s): V orders holding up to the reference's extra microbatches
 * compete with its own; the shortest is kept (gen_vocab.c). */
zb_status_t zb__vocab_wider_v(zb_schedule_t *s);
/* Any other kind with the passes placed (s): the local search within its own largest peak. */
zb_status_t zb__vocab_search(zb_schedule_t *s);
zb_status_t zb__gen_interleaved(zb_schedule_t *s);
/* Interleaved 1F1B with B and W split, rank r's W's held back r backwards; warm-up factor 1 or 2. */
zb_status_t zb__gen_interleaved_zb1(zb_schedule_t *s);
zb_status_t zb__gen_interleaved_zb2(zb_schedule_t *s);
zb_status_t zb__gen_zb_h1(zb_schedule_t *s);
zb_status_t zb__gen_zb_h2(zb_schedule_t *s);
zb_status_t zb__gen_zb_v(zb_schedule_t *s);
zb_status_t zb__gen_v_half(zb_schedule_t *s);
zb_status_t zb__gen_v_min(zb_schedule_t *s);
zb_status_t zb__gen_auto(zb_schedule_t *s, double limit);
/* Group-interleaved 1F1B, the PipeOffload paper's GIS, as the reference fork builds it (gen_gis.c). */
zb_status_t zb__gen_gis(zb_schedule_t *s);
/* The best schedule of every rule set (list scheduler and round-based) under `limit`, for the
 * placement s has: zb-v, v-half and v-min are this at their own limits. */
zb_status_t zb__gen_rules_best(zb_schedule_t *s, double limit);
/* zb-auto's last pass (fuse.c): each B whose W running apart does not make the schedule shorter
 * (largest rank span and end to end, simulated on s's costs) becomes a fused BW; schedules of
 * more than max_ops ops are left as they are, and the search stops at a work budget. */
zb_status_t zb__fuse_free(zb_schedule_t *s, int max_ops);
/* search.c: swaps of neighbouring ops judged by the simulator, each rank held to `limit` (<= 0:
 * none) where its list changed; s keeps the shortest order found, the given one unless a strictly
 * shorter one was. Deterministic; budget counts simulated ops over the tries. */
zb_status_t zb__local_search(zb_schedule_t *s, double limit, long long budget);
/* zb_schedule_refine's budget: 10 million simulated ops, about 100 ms on a 2020s core. */
#define ZB_REFINE_WORK 10000000LL
/* The first op's start to the last op's end over all ranks, for op times aligned with s->ops. */
double zb__makespan_of(const zb_schedule_t *s, const double *start, const double *end);
/* Cost, busy, bubble and peak memory (zb_sim_result_t) for op times aligned with s->ops. */
zb_sim_result_t zb__sim_stats(const zb_schedule_t *s, const double *start, const double *end);
/* The other way (fuse.c): from a schedule of fused backwards (1F1B), each BW of the last 2p + 2
 * microbatches is split into B + W, the W at the best of the next places, while that makes the
 * schedule shorter within `limit` (up to a work budget); what zb-auto tries besides its search. */
zb_status_t zb__unfuse_tail(zb_schedule_t *s, double limit, int max_ops);
/* V-Half (third = 0) and V-Min (third = 1) from the controllable-memory paper's building blocks,
 * squeezed (pattern_v.c): fills s->ops; the costs play no part in the shape. */
zb_status_t zb__pattern_v(zb_schedule_t *s, int third);

/* The list scheduler behind the zero-bubble generators (greedy.c): simulates time and, whenever a
 * rank is free, picks its next op by a fixed priority under a memory limit. What it returns is an
 * op order; re-simulating that order gives exactly the times the scheduler saw. */
typedef struct {
  double limit;     /* per-rank memory limit in microbatches, >= 1 */
  int w_before_f;   /* when an F and a W could both start, start the W first */
  int lookahead;    /* 1: do not start a W that would still run when a known B arrives */
  const int *warmup_cap; /* NULL or p values: most F's a rank may run before its first B */
  /* NULL or p values: W's a rank keeps pending while B's remain for it (run at the end), unless
   * memory needs them to let an F in. */
  const int *hold_w;
  int f_before_b; /* 1: an F that fits runs before a ready B (fills the pipeline sooner) */
} zb__greedy_policy_t;

/* Fills s->ops by the policy. ZB_ERR_INFEASIBLE if the limit is below 1 (no schedule can run in
 * less than one microbatch's activations through all of a rank's layers). */
zb_status_t zb__greedy_schedule(zb_schedule_t *s, const zb__greedy_policy_t *pol);

/* The placer (placer.c): round-based generators place ops one at a time, each timed from its
 * dependencies as the simulator will time it. A request that cannot run (a dependency not placed,
 * memory past `limit`) sets `failed`; zb__placer_finish then reports ZB_ERR_INFEASIBLE and the
 * generator's result is not a candidate. */
typedef struct {
  const zb_schedule_t *s;
  double limit;
  double *endF, *endB; /* per stage x microbatch; NaN until placed */
  int *nF, *nB, *nW;   /* per stage: ops of each type placed */
  double *cur, *mem;   /* per rank: clock, memory */
  double *bubble;      /* per rank: idle time since its first F */
  int *started;
  int *wq, *wq_head, *wq_tail; /* per rank: stages of B's whose W is pending, oldest first */
  zb__oplists_t ops;
  int failed, oom;
} zb__placer_t;

zb_status_t zb__placer_init(zb__placer_t *pl, const zb_schedule_t *s, double limit);
void zb__placer_free(zb__placer_t *pl);
/* When an op could start as far as its dependencies go (not the rank's clock); NaN if one is missing. */
double zb__placer_ready(const zb__placer_t *pl, int type, int stage, int mb);
/* When the cross-rank input of an op arrives; NaN if it has none or it is not placed. */
double zb__placer_arrival(const zb__placer_t *pl, int type, int stage, int mb);
/* Places the next F or B of a stage; 0 or -1 (failed). */
int zb__placer_put(zb__placer_t *pl, int type, int stage);
/* Places rank r's oldest pending W; 0 or -1. */
int zb__placer_put_w(zb__placer_t *pl, int r);
int zb__placer_pending_w(const zb__placer_t *pl, int r);
double zb__placer_next_w_cost(const zb__placer_t *pl, int r);
double zb__placer_max_bubble(const zb__placer_t *pl);
/* Runs every pending W, reports the per-rank bubbles (*max_bubble, bubble[p]; either may be NULL),
 * moves the op lists into s (or fails if the placer failed or did not place every op), and frees
 * the placer. */
zb_status_t zb__placer_finish(zb__placer_t *pl, zb_schedule_t *s, double *max_bubble,
                              double *bubble);

/* Round-based generators (rounds_v.c, rounds_loop.c): fill s->ops or fail with ZB_ERR_INFEASIBLE
 * when their rules cannot complete under `limit`. `allow` (NULL or p values) is each rank's idle
 * time the previous run of the same rules ended with: a rank may leave a hole up to the largest
 * allowance minus its own bubble so far instead of starting a W that would delay its next input's
 * consumer. *max_bubble gets the largest per-rank bubble of the result, *bubble (p values, may be
 * NULL) each rank's. */
typedef struct {
  double limit;
  int fill_f, fill_b;   /* V: start a W in a hole longer than the allowance before an F / a B */
  int early_f;          /* loop: warm-up forwards may overrun B0's arrival (reference's first rule) */
  int prioritize_b;     /* loop: a rank well ahead of the next skips its F when it would delay a B */
  int greedy_w;         /* loop: within the allowance, still start the W */
  const double *allow;
} zb__rounds_policy_t;

zb_status_t zb__rounds_v(zb_schedule_t *s, const zb__rounds_policy_t *pol, double *max_bubble,
                         double *bubble);
zb_status_t zb__rounds_loop(zb_schedule_t *s, const zb__rounds_policy_t *pol, double *max_bubble,
                            double *bubble);

/* Export writers; each returns a malloc'd NUL-terminated string. The schedule is simulated. */
zb_status_t zb__export_text(const zb_schedule_t *s, char **out, size_t *len);
zb_status_t zb__export_csv(const zb_schedule_t *s, char **out, size_t *len);
/* The compute_comms form; needs the schedule's times (simulated or measured). */
zb_status_t zb__export_csv_comms(const zb_schedule_t *s, char **out, size_t *len);
zb_status_t zb__export_json(const zb_schedule_t *s, char **out, size_t *len);
zb_status_t zb__export_chrome(const zb_schedule_t *s, char **out, size_t *len);
zb_status_t zb__export_svg(const zb_schedule_t *s, char **out, size_t *len);
zb_status_t zb__import_csv(zb_schedule_t **out, const char *text, size_t len,
                           const zb_schedule_spec_t *spec);

/* A growable string for the writers. */
typedef struct {
  char *buf;
  size_t len, cap;
  int oom;
} zb__sbuf_t;
void zb__sbuf_printf(zb__sbuf_t *b, const char *fmt, ...) ZB__PRINTF(2, 3);
void zb__sbuf_putc(zb__sbuf_t *b, char c);
/* Hands the string over (or fails with ZB_ERR_OUT_OF_MEMORY and frees it). */
zb_status_t zb__sbuf_finish(zb__sbuf_t *b, char **out, size_t *len);
/* A tick step for time axes: 1, 2 or 5 times a power of ten, at least `raw`. */
double zb__nice_step(double raw);

#endif /* ZB_SCHEDULE_INTERNAL_H */
