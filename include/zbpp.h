/*
 * zbpp.h - the one public header of zbpp, zero-bubble pipeline parallelism as a C library.
 *
 * What this is: the C ABI every other layer (the zbpp tool, the Python binding, the runtime) is built
 * on. Schedules are opaque handles created from a versioned spec struct; every call returns a
 * zb_status_t and leaves a per-thread message for zb_last_error().
 *
 * What this is not: a Python or C++ API. Nothing here exposes a struct layout that the library may
 * need to change, except the small plain-data records (zb_op_t, the spec and the result structs),
 * which are versioned by their first field.
 *
 * Threading: handles are not internally locked. Different handles may be used from different
 * threads at once; one handle must not be used from two threads at once, and the objects of one
 * rank (backend, W store, transport, runner) belong to one thread at a time.
 *
 * Blocking: schedule calls block only for the CPU work they do. Runtime calls may also wait, and
 * each one's comment says for what: zb_runner_run for its peers' messages (up to its timeout), the
 * optimizer and post-validation for the state they exchange, zb_backend_synchronize and the host
 * backend's work for the device or the CPU doing it.
 *
 * Versioned structs: each options struct starts with struct_size (and most with a version); the
 * library checks them and fails with a message naming the initialiser to use when a caller's
 * struct does not match. zb_runner_config_t and zb_wgrad_t also accept their previous, shorter
 * layouts (the newer fields then take their defaults).
 */
#ifndef ZBPP_H
#define ZBPP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define ZB_API __declspec(dllexport)
#else
#define ZB_API __attribute__((visibility("default")))
#endif

#define ZB_VERSION_MAJOR 0
#define ZB_VERSION_MINOR 1
#define ZB_VERSION_PATCH 0
/* Encoded as major*10000 + minor*100 + patch, like NCCL_VERSION_CODE. */
#define ZB_VERSION_CODE (ZB_VERSION_MAJOR * 10000 + ZB_VERSION_MINOR * 100 + ZB_VERSION_PATCH)

/* ---------------------------------------------------------------------------------------------
 * Status codes. One X-macro list so codes and their strings cannot drift.
 * ------------------------------------------------------------------------------------------- */
#define ZB_STATUS_LIST(X)                                                                          \
  X(ZB_OK, 0, "success")                                                                           \
  X(ZB_ERR_INVALID_ARGUMENT, 1, "invalid argument")                                                \
  X(ZB_ERR_OUT_OF_MEMORY, 2, "out of host memory")                                                 \
  X(ZB_ERR_INVALID_SCHEDULE, 3, "schedule breaks a rule")                                          \
  X(ZB_ERR_PARSE, 4, "malformed input")                                                            \
  X(ZB_ERR_INFEASIBLE, 5, "no schedule fits the request")                                          \
  X(ZB_ERR_UNSUPPORTED, 6, "not supported")                                                        \
  X(ZB_ERR_IO, 7, "input/output error")                                                            \
  X(ZB_ERR_BUSY, 8, "handle has work in flight")                                                   \
  X(ZB_ERR_TIMEOUT, 9, "timed out")                                                                \
  X(ZB_ERR_REMOTE, 10, "a peer rank failed")                                                       \
  X(ZB_ERR_CUDA, 11, "CUDA error")                                                                 \
  X(ZB_ERR_NCCL, 12, "NCCL error")                                                                 \
  X(ZB_ERR_CUBLAS, 13, "cuBLAS error")                                                             \
  X(ZB_ERR_INTERNAL, 14, "internal error")

typedef enum {
#define ZB_X_ENUM(name, value, text) name = value,
  ZB_STATUS_LIST(ZB_X_ENUM)
#undef ZB_X_ENUM
} zb_status_t;

/* A static string for a status code; "unknown status" for values outside the list. */
ZB_API const char *zb_status_string(zb_status_t status);

/* The message left by the last failing zbpp call on this thread ("" if none yet). The pointer
 * stays valid until the next zbpp call on this thread; copy it if you need it longer. With the
 * environment variable ZBPP_DEBUG set (not "" or "0") when the library first fails, messages start
 * with the library's source position ("runner.c:602: "), for debugging zbpp itself. */
ZB_API const char *zb_last_error(void);

/* The library's version string, e.g. "0.1.0", and code (ZB_VERSION_CODE of the built library). */
ZB_API const char *zb_version(void);
ZB_API int zb_version_code(void);

/* Frees memory that a zbpp call handed to the caller (for example zb_schedule_export's text).
 * zb_free(NULL) does nothing. */
ZB_API void zb_free(void *ptr);

/* ---------------------------------------------------------------------------------------------
 * The schedule model (DESIGN.md section 3).
 *
 * p ranks, v chunks per rank, S = p*v stages, m microbatches. Placement "loop" puts stage s on rank
 * s mod p; placement "v" (v = 2) puts stage s on rank s for s < p and on rank 2p-1-s otherwise.
 * ------------------------------------------------------------------------------------------- */
typedef enum {
  ZB_OP_F = 0,  /* forward */
  ZB_OP_B = 1,  /* backward for the input only */
  ZB_OP_W = 2,  /* backward for the weights only */
  ZB_OP_BW = 3, /* fused backward (B and W together, as 1F1B runs it) */
  /* PipeOffload's copies, on the rank's copy lane beside its compute: OFFLOAD moves the
   * activations (stage, mb)'s F saved to host memory, RELOAD brings them back before its backward
   * (B or BW, and W) reads them. They run after the op before them in the list has started (the
   * point where the runtime issues them) and after their dependency (OFFLOAD after the F, RELOAD
   * after the OFFLOAD), one at a time on the lane, and never hold up compute by themselves. */
  ZB_OP_OFFLOAD = 4,
  ZB_OP_RELOAD = 5,
  /* Vocabulary Parallelism's passes (spec version 3, `vocab`): the output layer and the input
   * embedding split over the vocabulary across every rank, one of each pass per rank and
   * microbatch. They belong to no stage: `stage` holds the rank that runs them. S runs the output
   * layer's forward on the rank's shard after F(S-1, mb) (whose hidden state every rank gets, with
   * T_comm where it crosses ranks); T its backward, after the barrier joining every rank's S(mb).
   * IF runs the input embedding's forward on the shard; F(0, mb) waits for the barrier joining
   * every rank's IF(mb). IB its backward, after B/BW(0, mb) (plus T_comm across ranks). A barrier
   * starts when the last rank's pass ends and lasts T_VOCAB_COMM (the all-reduces, on a stream of
   * their own). vocab = 2 (the reference's Vocab-2, backward fused into S): B/BW(S-1, mb) waits for
   * the S barrier; vocab = 1 (Vocab-1): a second barrier after every rank's T(mb), which B/BW(S-1,
   * mb) waits for. The collectives run beside the compute, not in the passes (see vocab_cb). */
  ZB_OP_S = 6,
  ZB_OP_T = 7,
  ZB_OP_IF = 8,
  ZB_OP_IB = 9,
} zb_op_type_t;

typedef struct {
  int32_t type;  /* a zb_op_type_t */
  int32_t stage; /* 0 .. S-1 (S, T, IF, IB: the rank, 0 .. p-1) */
  int32_t mb;    /* microbatch, 0 .. m-1 */
} zb_op_t;

typedef enum {
  ZB_PLACEMENT_LOOP = 0,
  ZB_PLACEMENT_V = 1,
  ZB_PLACEMENT_CUSTOM = 2, /* an explicit stage-to-rank map (zb_schedule_create_from_ops_mapped) */
} zb_placement_t;

#define ZB_KIND_LIST(X)                                                                            \
  X(ZB_KIND_GPIPE, 0, "gpipe", "all forwards, then all fused backwards (peak memory m)")           \
  X(ZB_KIND_1F1B, 1, "1f1b", "one forward one backward, fused backward (PipeDream-flush, peak p)") \
  X(ZB_KIND_INTERLEAVED_1F1B, 2, "interleaved-1f1b",                                               \
    "Megatron's interleaved 1F1B, v chunks in a loop, m in rounds of ~p (torch's rule)")           \
  X(ZB_KIND_ZB_H1, 3, "zb-h1", "handcrafted zero bubble, 1F1B's memory (p), about 1/3 the bubble") \
  X(ZB_KIND_ZB_H2, 4, "zb-h2", "handcrafted zero bubble, memory 2p-1, no bubble once m is large") \
  X(ZB_KIND_ZB_V, 5, "zb-v", "two chunks in a V, memory p, no bubble once m >= 2p")                \
  X(ZB_KIND_V_HALF, 6, "v-half", "V schedule at about half of 1F1B's activation memory")           \
  X(ZB_KIND_V_MIN, 7, "v-min", "V schedule at about a third of 1F1B's activation memory")          \
  X(ZB_KIND_ZB_AUTO, 8, "zb-auto",                                                                 \
    "automatic: the shortest schedule found for the costs under a memory limit (default p)")       \
  X(ZB_KIND_CUSTOM, 9, "custom", "imported from a file; no generator")                            \
  X(ZB_KIND_GROUP_INTERLEAVED_1F1B, 10, "group-interleaved-1f1b",                                  \
    "PipeOffload's base schedule (GIS): v chunks in a loop, groups of about p/2 microbatches, B and W split")

typedef enum {
#define ZB_X_ENUM(name, value, text, help) name = value,
  ZB_KIND_LIST(ZB_X_ENUM)
#undef ZB_X_ENUM
} zb_kind_t;

#define ZB_KIND_COUNT 11

/* Name ("zb-v") and one-line description of a kind; NULL for values outside the list. */
ZB_API const char *zb_kind_name(zb_kind_t kind);
ZB_API const char *zb_kind_help(zb_kind_t kind);
/* Looks a kind up by name, case-insensitively; '_' and '-' are the same. Also accepts the aliases
 * "zb-1p" (zb-auto at limit p), "zb-2p" (zb-auto at limit 2p, see zb_kind_default_limit) and
 * torch.distributed.pipelining's class names (1F1B, Interleaved1F1B, GPipe, ZBVZeroBubble,
 * InterleavedZeroBubble). Fails with ZB_ERR_INVALID_ARGUMENT and a message listing valid names. */
ZB_API zb_status_t zb_kind_from_name(const char *name, zb_kind_t *out_kind, double *out_mem_limit_factor);

/* ---------------------------------------------------------------------------------------------
 * The spec a schedule is generated from. Initialise with ZB_SCHEDULE_SPEC_INIT and change what you
 * need; struct_size and version must be this header's (ZB_SCHEDULE_SPEC_INIT sets them), or the
 * library refuses the spec with a message saying so.
 *
 * Times: time_f/time_b/time_w/time_bw are the time of one microbatch through ALL of a rank's layers
 * (so each op of a v-chunk schedule takes 1/v of it). A value <= 0 for time_bw means time_b + time_w.
 * stage_time_f/b/w/bw, when not NULL, point at S values each (one per stage, absolute, not divided by
 * v) and override the scalar for that op type; they are copied during the call (the caller keeps
 * ownership). mem_limit is in units of one microbatch's activations through all of a rank's layers;
 * <= 0 means no limit (zb-auto then keeps 1F1B's memory, p).
 * ------------------------------------------------------------------------------------------- */
#define ZB_SCHEDULE_SPEC_VERSION 3

typedef struct {
  uint32_t struct_size; /* sizeof(zb_schedule_spec_t) as the caller compiled it */
  uint32_t version;     /* ZB_SCHEDULE_SPEC_VERSION */
  zb_kind_t kind;
  int32_t ranks;        /* p >= 1 */
  int32_t chunks;       /* v >= 1; 0 means the kind's default (2 for V kinds and interleaved, else 1) */
  int32_t microbatches; /* m >= 1 (some kinds need more; the error says how many) */
  double time_f, time_b, time_w, time_bw;
  const double *stage_time_f, *stage_time_b, *stage_time_w, *stage_time_bw;
  double time_comm; /* added to every dependency that crosses ranks */
  double w_share;   /* w = M_W/M_B in [0, 1]: the share of activations only W needs */
  double mem_limit; /* <= 0: none */
  /* Where stages go. placement_set = 0 (the default): the kind's own placement (V for zb-v,
   * v-half, v-min and zb-auto with v = 2; loop otherwise). placement_set = 1: `placement`, which
   * zb-auto takes as loop placement with any v >= 1 (stage s on rank s mod p, as torch's
   * interleaved schedules place them) or V with v = 2; other kinds must get their own. */
  int32_t placement_set;
  zb_placement_t placement;
  /* Version 2: the time to copy one microbatch's activations through all of a rank's layers to
   * host memory (OFFLOAD) and back (RELOAD), per rank like the other times (a stage's is 1/v of
   * it), or per stage (S values, absolute) when the arrays are given. Only schedules with
   * OFFLOAD/RELOAD ops use them. */
  double time_offload, time_reload;
  const double *stage_time_offload, *stage_time_reload;
  /* Version 3: Vocabulary Parallelism (ZB_OP_S and the other vocabulary passes). vocab: 0 none;
   * 1 two barriers a microbatch (the reference's Vocab-1); 2 one barrier, the output layer's input
   * gradient fused into S (Vocab-2). The times are one rank's pass on its shard of the vocabulary
   * (the same on every rank), and time_vocab_comm one barrier's all-reduces. zb_schedule_create
   * places the passes: 1F1B in the reference's own order (sail-sg/VocabularyParallelism), every
   * other kind by simulating its order and running each pass at a rank's next op boundary once it
   * is due (csrc/schedule/simulate.c, zb__place_vocab). */
  int32_t vocab;
  double time_s, time_t, time_if, time_ib, time_vocab_comm;
} zb_schedule_spec_t;

#define ZB_SCHEDULE_SPEC_INIT                                                                      \
  {                                                                                                \
    sizeof(zb_schedule_spec_t), ZB_SCHEDULE_SPEC_VERSION, ZB_KIND_1F1B, 1, 0, 1, 1.0, 1.0, 1.0,    \
        0.0, NULL, NULL, NULL, NULL, 0.0, 0.5, 0.0, 0, ZB_PLACEMENT_LOOP, 0.0, 0.0, NULL, NULL, 0, \
        0.0, 0.0, 0.0, 0.0, 0.0                                                                     \
  }

typedef struct zb_schedule zb_schedule_t; /* opaque */

/* Generates a schedule of spec->kind. Blocks for the time generation takes (well under a second for
 * zb-auto at p = 64, m = 1024). On failure *out is NULL and the message says what was wrong and
 * what is allowed (e.g. the smallest m, or the smallest feasible memory limit). */
ZB_API zb_status_t zb_schedule_create(zb_schedule_t **out, const zb_schedule_spec_t *spec);

/* Builds a schedule from explicit per-rank op lists (kind "custom"). rank_ops[r] points at
 * rank_counts[r] ops; everything is copied. Placement must be given; p, v and m come from the spec
 * (spec->kind is ignored). The schedule is not validated here: call zb_schedule_validate. */
ZB_API zb_status_t zb_schedule_create_from_ops(zb_schedule_t **out, const zb_schedule_spec_t *spec,
                                               zb_placement_t placement,
                                               const zb_op_t *const *rank_ops,
                                               const int32_t *rank_counts);

/* The same over an explicit stage-to-rank map: stage s (0 <= s < num_stages) lives on rank
 * stage_ranks[s], any map in which every rank holds at least one stage, so ranks may hold
 * different numbers of stages (torch's custom stage ids, e.g. stages {0, 1, 4} on rank 0 and
 * {2, 3} on rank 1). p and m come from the spec (spec->chunks is ignored: v is the most stages any
 * rank holds); per-stage time arrays in the spec have num_stages entries, and a per-rank scalar
 * time is divided among the stages of each rank. A map that is the loop or the V gives that
 * placement; any other gives ZB_PLACEMENT_CUSTOM. Not validated here: call zb_schedule_validate.
 * (The post-validated optimizer's configuration takes loop and V placements only.) */
ZB_API zb_status_t zb_schedule_create_from_ops_mapped(zb_schedule_t **out, const zb_schedule_spec_t *spec,
                                                      const int32_t *stage_ranks, int32_t num_stages,
                                                      const zb_op_t *const *rank_ops,
                                                      const int32_t *rank_counts);

/* zb_schedule_destroy(NULL) is a no-op that succeeds. */
ZB_API zb_status_t zb_schedule_destroy(zb_schedule_t *schedule);

typedef struct {
  zb_kind_t kind;
  int32_t ranks, chunks, stages, microbatches;
  zb_placement_t placement;
  double w_share;
  double mem_limit; /* <= 0: none */
  double time_comm;
} zb_schedule_info_t;

ZB_API zb_status_t zb_schedule_get_info(const zb_schedule_t *schedule, zb_schedule_info_t *out);

/* Rank r's ops in execution order. *ops stays owned by the schedule and valid until it is destroyed. */
ZB_API zb_status_t zb_schedule_rank_ops(const zb_schedule_t *schedule, int32_t rank,
                                        const zb_op_t **ops, int32_t *count);

/* The rank that holds a stage under the schedule's placement. */
ZB_API zb_status_t zb_schedule_stage_rank(const zb_schedule_t *schedule, int32_t stage, int32_t *rank);

/* The per-stage time of one op (already divided by v where the spec gave per-rank times). */
ZB_API zb_status_t zb_schedule_op_time(const zb_schedule_t *schedule, zb_op_type_t type,
                                       int32_t stage, double *out);

/* Checks every rule of DESIGN.md section 3: each (stage, microbatch) has one F and either one BW or
 * one B and one W, each op on the rank its stage lives on, dependencies in order within a rank, FIFO
 * channels, no deadlock under the runtime's channel model, and memory under the limit when one is
 * set. An OFFLOAD of (stage, mb) comes after its F and is followed by exactly one RELOAD, which
 * comes before its backward; the limit bounds device-resident memory. ZB_ERR_INVALID_SCHEDULE with
 * a message naming the rank, the position and the rule broken. */
ZB_API zb_status_t zb_schedule_validate(const zb_schedule_t *schedule);

typedef struct {
  double cost;        /* the largest span of any rank */
  double bubble_rate; /* (cost - busy) / cost, busy = the largest total compute of any rank */
  double busy;
  double max_peak_memory;
} zb_sim_result_t;

/* Simulates the schedule (DESIGN.md section 3 times and memory). Fails with ZB_ERR_INVALID_SCHEDULE
 * if it cannot run (missing dependencies, deadlock). Results stay in the handle; the accessors below
 * read them. */
ZB_API zb_status_t zb_schedule_simulate(zb_schedule_t *schedule, zb_sim_result_t *out);

/* The step's figures beside the bubble rate, from the current times (simulated or set_times):
 * *makespan (may be NULL) the step from the first op's start on any rank to the last op's end on
 * any rank (as zb_schedule_makespan_durations measures it); *idle_rate (may be NULL) the share of all ranks' time over the makespan that no
 * compute op fills, 1 - (sum of the ranks' busy time) / (ranks x makespan). zb_sim_result_t's
 * bubble_rate is the paper's: the busiest rank's idle share of its own span, which is 0 for a
 * schedule whose busiest rank never waits however long the others wait at the step's ends (the
 * fill and drain a picture shows); idle_rate counts those waits. ZB_ERR_INVALID_ARGUMENT before the
 * schedule has times. */
ZB_API zb_status_t zb_schedule_step_idle(const zb_schedule_t *schedule, double *makespan, double *idle_rate);

/* What the exports call the schedule and its time. name: the title of the svg, chrome and text
 * exports (NULL or "": the kind's name; e.g. "zb-v, measured step 3"); time_unit: the unit of its
 * times ("ms" for measured ones; NULL or "": none named, the unit of the costs given); time_span:
 * > 0 draws the svg's time axis over this much time from the step's start (0: its own makespan),
 * at a fixed width, so pictures given the same span share one scale. Copied into the handle. */
ZB_API zb_status_t zb_schedule_set_display(zb_schedule_t *schedule, const char *name, const char *time_unit,
                                           double time_span);

/* A cost (largest rank span) that no schedule with this one's ranks, stages, placement, microbatches,
 * costs and memory limit can go below, whatever its op order: the busiest rank's work, one
 * microbatch's round trip and, for loop placement with one stage per rank, each rank's warm-up and
 * drain under the memory limit (csrc/schedule/bound.c says why each holds). A schedule whose
 * simulated cost equals it is shortest; the gap is the most any scheduler could still win. Needs no
 * simulation; it reads the op lists only to see whether they hold copies (OFFLOAD/RELOAD), with
 * which the memory limit no longer bounds the warm-up and drain. */
ZB_API zb_status_t zb_schedule_cost_bound(const zb_schedule_t *schedule, double *out_cost);

/* Simulates the schedule's op order with the given durations instead of its per-stage costs:
 * durations[r] points at rank r's op durations, aligned with zb_schedule_rank_ops (T_comm, memory and
 * the rules as zb_schedule_simulate). *out gets the figures, busy from these durations; the handle's
 * own simulation is left as it was, so this can be called many times (e.g. with op times drawn from
 * a measured spread, to see what noise does to a plan). */
ZB_API zb_status_t zb_schedule_simulate_durations(const zb_schedule_t *schedule,
                                                  const double *const *durations, zb_sim_result_t *out);
/* As zb_schedule_simulate_durations, but *out_makespan gets the end-to-end time: the last op's end
 * less the first op's start over every rank. The figures' cost is the largest single rank's span
 * (the paper's measure, which bubble rates use); a step timed by a wall clock also holds the ranks'
 * staggered starts (the last rank of a pipeline starts p - 1 forwards after the first). */
ZB_API zb_status_t zb_schedule_makespan_durations(const zb_schedule_t *schedule,
                                                  const double *const *durations, double *out_makespan);

/* After zb_schedule_simulate: start/end of rank r's ops (aligned with zb_schedule_rank_ops). */
ZB_API zb_status_t zb_schedule_rank_times(const zb_schedule_t *schedule, int32_t rank,
                                          const double **start, const double **end);
/* After zb_schedule_simulate: rank r's span, busy time and peak memory. */
ZB_API zb_status_t zb_schedule_rank_stats(const zb_schedule_t *schedule, int32_t rank, double *span,
                                          double *busy, double *peak_memory);
/* After zb_schedule_simulate: rank r's peak of activations resident on the device (the same as
 * zb_schedule_rank_stats' peak_memory) and of activations held in host memory by OFFLOAD ops, both
 * in microbatches through all of the rank's layers, counted in time order over the compute and the
 * copy lane: F adds its share at its start, B/W/BW free theirs at their end, an OFFLOAD moves the
 * (stage, mb)'s share from the device (freed at its end) to the host (taken at its start), a
 * RELOAD moves it back (device taken at its start, host freed at its end). */
ZB_API zb_status_t zb_schedule_rank_memory(const zb_schedule_t *schedule, int32_t rank, double *device_peak,
                                           double *host_peak);

/* The offload pass (PipeOffload): a new schedule, *out, with the same compute ops in the same
 * order and OFFLOAD/RELOAD copies added where they pay (the schedule's own T_OFFLOAD/T_RELOAD).
 * The rule (csrc/schedule/offload.c): microbatches whose activations live at least a round trip
 * are tried longest-lived first; each gets its OFFLOAD right after its F and its RELOAD after the
 * latest compute op that leaves T_RELOAD before its backward; a candidate is kept only when the
 * step (makespan) and the largest rank span (the cost) stay within (1 + slowdown) of the schedule
 * without copies, the rank's device peak does not grow and the host peak stays under host_limit. A copy that does not fit is left
 * out, never an error. With device_limit > 0 the pass stops once every rank's device peak is at
 * most that; with <= 0 it offloads all it can. Each try is a simulation: past a work budget
 * (about a second on large pipelines) the pass keeps what it placed and stops. A slowdown is what
 * the step may pay for memory: the result is the plan without slowdown unless the one with it
 * lowers the largest device peak. *out comes simulated; schedule is not changed. */
#define ZB_OFFLOAD_CONFIG_VERSION 1

typedef struct {
  uint32_t struct_size; /* sizeof(zb_offload_config_t) */
  uint32_t version;     /* ZB_OFFLOAD_CONFIG_VERSION */
  double device_limit;  /* microbatches through all of a rank's layers; <= 0: offload all that fits */
  double slowdown;      /* the step may grow by this fraction at most (>= 0; 0: not at all) */
  double host_limit;    /* microbatches held in host memory per rank at most; <= 0: none */
  /* Which stages' activations may move: S flags (nonzero: its microbatches are candidates), read
   * during the call; NULL: every stage. A struct_size that ends before this field means NULL. */
  const uint8_t *stages;
  /* 1: ranks 2k and 2k+1 share one link to host memory (two GPUs under one PCIe switch, as the
   * reference fork assumes): a copy is kept only where no copy of the pair's other rank runs at
   * the same time in the plan, so the pair's copies take turns on the link. 0: every rank has its
   * own. A struct_size that ends before this field means 0. */
  int32_t paired_lanes;
} zb_offload_config_t;

#define ZB_OFFLOAD_CONFIG_INIT {sizeof(zb_offload_config_t), ZB_OFFLOAD_CONFIG_VERSION, 0.0, 0.0, 0.0, NULL, 0}

/* config may be NULL for ZB_OFFLOAD_CONFIG_INIT. */
ZB_API zb_status_t zb_schedule_plan_offload(zb_schedule_t **out, const zb_schedule_t *schedule,
                                            const zb_offload_config_t *config);

/* A new schedule, *out: schedule's ops (without copies) reordered by a local search judged by the
 * simulator: swaps of two neighbouring ops of a rank that share no channel and no (stage, mb),
 * kept while the step gets no longer and the rank's device peak stays within device_limit (<= 0:
 * the schedule's own largest peak); the shortest order found, or the one given when none is
 * strictly shorter. Deterministic (a fixed seed and a work budget of about 100 ms, not wall time),
 * so every rank refines to the same schedule. For the memory-tight V kinds, whose rule-built orders
 * a solver finds up to a few percent above the optimum. *out comes unsimulated. */
ZB_API zb_status_t zb_schedule_refine(zb_schedule_t **out, const zb_schedule_t *schedule, double device_limit);

/* Generates spec's kind with PipeOffload's copies (spec's T_OFFLOAD/T_RELOAD). A fixed order gets
 * zb_schedule_plan_offload's copies. v-min and v-half under a device_limit choose their order too:
 * their own and the V orders that hold more (v-half's and ZB-V's for v-min; ZB-V's for v-half),
 * each refined (zb_schedule_refine) and taken down to the limit by the pass; the shortest step
 * that fits wins, so the result's kind may be another V kind's (v-min held to its own peak at
 * p = 4, m = 16 steps as v-half does, 50.5 against 53.5, with copies of a quarter of F; the
 * command: zbpp schedule v-min -p 4 -m 16 --copy-times 0.25,0.25 --offload --offload-limit 2).
 * zb-auto plans order and copies together: it plans orders for
 * device_limit (config's, else spec->mem_limit, else p) and for more memory (1.25, 1.5, 2, 2.5, 3
 * and 4 times it, and none), takes each down to the limit with the offload pass, and keeps the
 * shortest step whose every rank's device peak is within the limit (the order for the limit
 * itself always is). ZB_ERR_INFEASIBLE only when no order fits the limit at all. Blocks for
 * several generations and passes (a second or more on large pipelines). */
ZB_API zb_status_t zb_schedule_create_offloaded(zb_schedule_t **out, const zb_schedule_spec_t *spec,
                                                const zb_offload_config_t *config);

typedef enum {
  ZB_FORMAT_TEXT = 0,   /* a rank-by-time grid for a terminal */
  ZB_FORMAT_CSV = 1,    /* torch.distributed.pipelining's compute_only action grammar */
  ZB_FORMAT_JSON = 2,   /* the zbpp JSON shape (docs/tool.md) */
  ZB_FORMAT_CHROME = 3, /* Chrome trace / Perfetto JSON */
  ZB_FORMAT_SVG = 4,    /* a timeline in the style of the paper's figures */
  ZB_FORMAT_CSV_COMMS = 5, /* torch's compute_comms form: the CSV with SEND_F/RECV_F/SEND_B/RECV_B */
} zb_format_t;

/* Parses "text", "csv", "json", "chrome", "svg" or "csv-comms". */
ZB_API zb_status_t zb_format_from_name(const char *name, zb_format_t *out);

/* Writes the schedule in a format into a NUL-terminated buffer the caller frees with zb_free.
 * Formats with times (text, json, chrome, svg) simulate first if that has not been done. */
ZB_API zb_status_t zb_schedule_export(zb_schedule_t *schedule, zb_format_t format, char **out_text,
                                      size_t *out_len);

/* Reads a schedule from text. Only ZB_FORMAT_CSV is accepted: one row per rank, cells like "0F3"
 * (stage, type, microbatch) where the type is F, I (our B), W, or B (our BW, torch's full backward);
 * empty cells (torch's idle steps) and torch's transfer cells (SEND_F, RECV_F, SEND_B, RECV_B) are
 * skipped, and so is REDUCE_GRAD; a pair "(0F1;3B0)OVERLAP_F_B" gives its ops in order; UNSHARD and
 * RESHARD fail with ZB_ERR_PARSE. p is the number of rows, S the largest stage + 1,
 * v = S / p, m the largest microbatch + 1, and the placement is inferred (V when stage p sits on rank
 * p-1). Costs, w-share and memory limit come from spec (its ranks/chunks/microbatches/kind are
 * ignored, except that per-stage time arrays need ranks * chunks to equal the file's stage count;
 * spec may be NULL for the defaults). The result is not validated: call zb_schedule_validate. */
ZB_API zb_status_t zb_schedule_import(zb_schedule_t **out, zb_format_t format, const char *text,
                                      size_t len, const zb_schedule_spec_t *spec);

/* ---------------------------------------------------------------------------------------------
 * Measured timelines (the runtime's per-op timings fed back into the schedule model).
 * ------------------------------------------------------------------------------------------- */

/* Replaces the schedule's simulated times with measured ones: start[r]/end[r] point at rank r's op
 * times (aligned with zb_schedule_rank_ops; seconds on any common clock, e.g. zb_runner_times), for
 * every rank r. The values are copied, shifted so the earliest start is 0, and stored in
 * milliseconds (the unit the exports assume, e.g. for Chrome-trace microseconds). Afterwards the
 * accessors and exports (text, JSON, Chrome trace, SVG) show the measured timeline; span, busy and
 * bubble are computed from it as zb_schedule_simulate does (peak memory from the op order). *out (may
 * be NULL) gets those figures. A later zb_schedule_simulate does not overwrite them; create the
 * schedule again to simulate. */
ZB_API zb_status_t zb_schedule_set_times(zb_schedule_t *schedule, const double *const *start,
                                         const double *const *end, zb_sim_result_t *out);

/* Per-stage mean op durations of the current times (simulated: the spec's units; measured:
 * milliseconds), S values each; a stage
 * with no op of a type gets 0 there. Any pointer may be NULL. Feed them back as
 * zb_schedule_spec_t.stage_time_* to let zb-auto plan for the costs a run really had. */
ZB_API zb_status_t zb_schedule_stage_costs(const zb_schedule_t *schedule, double *time_f,
                                           double *time_b, double *time_w, double *time_bw);

/* ---------------------------------------------------------------------------------------------
 * Runtime (DESIGN.md section 4): backends, transports, the W store, the runner, the optimizer.
 *
 * Thread model: every handle below belongs to one rank and is used by one thread at a time, except
 * zb_inproc_group_t, which all ranks of a process share (it is internally locked).
 * ------------------------------------------------------------------------------------------- */

typedef enum {
  ZB_DTYPE_F32 = 0,
  ZB_DTYPE_F16 = 1,
  ZB_DTYPE_BF16 = 2,
} zb_dtype_t;

/* The optimizers zb_optimizer and zb_optim_step implement (torch.optim.SGD and AdamW). */
typedef enum {
  ZB_OPTIM_SGD = 0,
  ZB_OPTIM_ADAMW = 1,
} zb_optim_kind_t;

/* A backend owns memory, the compute stream and the GEMMs of one rank. The host backend is
 * synchronous: its "streams" run work when it is issued, and GEMMs go through the system's CBLAS.
 * Half-precision inputs are widened to fp32 before the GEMM there (a host reference, not fast). */
typedef struct zb_backend zb_backend_t;

ZB_API zb_status_t zb_backend_create_host(zb_backend_t **out);
/* Fails with ZB_ERR_BUSY, and frees nothing, while a runner, W store or transport that uses it
 * still exists (a transport uses the backend of the first runner created on it, or the one an NCCL
 * transport was created with). NULL is a no-op. */
ZB_API zb_status_t zb_backend_destroy(zb_backend_t *backend);
/* "host" or "cuda". The pointer is static. */
ZB_API const char *zb_backend_name(const zb_backend_t *backend);

/* The CUDA backend: device memory (cudaMalloc), one compute stream, and the W store's GEMMs through
 * cuBLASLt on that stream. Every call that takes a CUDA backend only enqueues work on the compute
 * stream and returns (it does not block) unless its comment says otherwise.
 *
 * The compute stream is the caller's when `stream` is given (a cudaStream_t, for example
 * torch.cuda.current_stream().cuda_stream): the backend borrows it and never destroys it. With
 * stream NULL the backend creates a non-blocking stream of its own. The cuBLASLt workspace
 * (workspace_bytes, 0: 32 MiB) is allocated once at creation and owned by the backend.
 *
 * cuBLASLt and NCCL are not linked: the backend and the NCCL transport find them at run time,
 * preferring copies the process has already loaded (import torch first and zbpp uses torch's), then
 * libcublasLt.so.13/.12 and libnccl.so.2 on the loader's path. CUDA itself is linked statically.
 * Builds without nvcc have the functions too; they fail with ZB_ERR_UNSUPPORTED. Without a GPU,
 * creation fails with ZB_ERR_CUDA and CUDA's message ("no CUDA-capable device is detected"). */
#define ZB_CUDA_BACKEND_CONFIG_VERSION 1

typedef struct {
  uint32_t struct_size; /* sizeof(zb_cuda_backend_config_t) */
  uint32_t version;     /* ZB_CUDA_BACKEND_CONFIG_VERSION */
  int32_t device;       /* CUDA device ordinal */
  void *stream;         /* cudaStream_t to borrow as the compute stream; NULL: create one */
  size_t workspace_bytes; /* cuBLASLt workspace; 0: 32 MiB */
} zb_cuda_backend_config_t;

#define ZB_CUDA_BACKEND_CONFIG_INIT                                                                \
  { sizeof(zb_cuda_backend_config_t), ZB_CUDA_BACKEND_CONFIG_VERSION, 0, NULL, 0 }

/* 1 when this library was built with CUDA (the functions below can work), 0 otherwise. */
ZB_API int zb_cuda_built(void);
/* Number of CUDA devices this process sees (0 without a GPU or driver; never fails for that). */
ZB_API zb_status_t zb_cuda_device_count(int32_t *out);
ZB_API zb_status_t zb_backend_create_cuda(zb_backend_t **out, const zb_cuda_backend_config_t *config);
/* Makes `stream` (a cudaStream_t, borrowed) the compute stream from now on, e.g. torch's current
 * stream before each iteration; work already issued stays ordered before later work by an event.
 * NULL goes back to the backend's own stream, so name the legacy default stream (torch's default
 * stream, handle 0) as cudaStreamLegacy ((void *)1); cudaStreamPerThread works too. A borrowed
 * stream must outlive its use. On the host backend only NULL is accepted.
 *
 * Every CUDA backend call makes the backend's device current on the calling thread (cudaSetDevice)
 * and leaves it so; a thread that drives several GPUs sets its device again afterwards. */
ZB_API zb_status_t zb_backend_set_stream(zb_backend_t *backend, void *stream);
/* Blocks the host until everything issued on the compute stream has finished (host: returns). */
ZB_API zb_status_t zb_backend_synchronize(zb_backend_t *backend);
/* Memory the backend's work can use: device memory on CUDA, host memory on the host backend.
 * zb_backend_free(backend, NULL) is a no-op. zb_backend_copy copies `bytes` between two such
 * buffers (or from/to host memory on CUDA: cudaMemcpyDefault) on the compute stream. */
ZB_API zb_status_t zb_backend_alloc(zb_backend_t *backend, size_t bytes, void **out);
ZB_API zb_status_t zb_backend_free(zb_backend_t *backend, void *ptr);
ZB_API zb_status_t zb_backend_copy(zb_backend_t *backend, void *dst, const void *src, size_t bytes);

/* ---- optimizer kernels (the CUDA backend's, with a host reference on the host backend) ----------
 * Each call runs over a list of tensors in one launch per call on the CUDA backend (kernels/, one .cu per kernel)
 * and as the plain C reference on the host backend; the GPU tests use the host backend as their
 * oracle. Pointers in the lists are backend memory (device on CUDA); the list arrays themselves are
 * host memory, read during the call. The work is enqueued on the compute stream. */
typedef struct {
  int32_t count;
  void *const *ptrs;     /* count tensors, each dense */
  const int64_t *numels; /* elements of each */
} zb_tensor_list_t;

/* sq_out[0] += sum of the squares of every element (accumulated in double), and nonfinite_out[0] = 1
 * if any element is inf or NaN (left as it was otherwise). Both outputs are backend memory. The sum
 * is deterministic: the same inputs give the same bits on the same device and launch shape. On the
 * host it is one sequential double accumulator over the tensors in list order (zb_optimizer's). */
ZB_API zb_status_t zb_sq_norm(zb_backend_t *backend, zb_dtype_t dtype, const zb_tensor_list_t *tensors,
                              double *sq_out, int32_t *nonfinite_out);

/* In place: every element *= factor (in fp32, rounded back to dtype), and nonfinite_out[0] = 1 if any
 * result is inf or NaN: torch's _amp_foreach_non_finite_check_and_unscale_ with factor = 1/scale. */
ZB_API zb_status_t zb_unscale(zb_backend_t *backend, zb_dtype_t dtype, const zb_tensor_list_t *tensors,
                              float factor, int32_t *nonfinite_out);

/* The dynamic loss scale update of torch.cuda.amp.GradScaler (_amp_update_scale_), in backend
 * memory: if *nonfinite, *scale *= backoff and *growth_tracker = 0; else ++*growth_tracker and, when
 * it reaches growth_interval, *scale *= growth (kept only if finite) and *growth_tracker = 0. */
ZB_API zb_status_t zb_loss_scale_update(zb_backend_t *backend, float *scale, int32_t *growth_tracker,
                                        const int32_t *nonfinite, double growth, double backoff,
                                        int32_t growth_interval);

/* One fused AdamW or SGD step over fp32 master weights, with exactly the formulas of zb_optimizer
 * (torch.optim.AdamW / SGD, see zb_optimizer_config_t): every gradient element is first multiplied by
 * `factor` in fp32 (1/loss_scale times the clipping coefficient). Gradients may be fp32, bf16 or f16
 * (widened to fp32). With `undo` set, the kernel first saves what the step changes, so zb_optim_undo
 * restores the parameters and the state bit for bit (post-validation's rollback). Memory of the undo
 * buffer, per parameter element: AdamW 12 bytes (param, exp_avg, exp_avg_sq), SGD with momentum 8,
 * plain SGD 4; zb_optim_undo_bytes gives the size. The step count is the caller's (host) state. */
#define ZB_OPTIM_STEP_VERSION 1

typedef struct {
  uint32_t struct_size; /* sizeof(zb_optim_step_t) */
  uint32_t version;     /* ZB_OPTIM_STEP_VERSION */
  zb_optim_kind_t kind;
  double lr, momentum, beta1, beta2, eps, weight_decay; /* as in zb_optimizer_config_t */
  int64_t step;        /* this step's number t: 1 for the first (bias correction, SGD's first step) */
  float factor;        /* gradient multiplier */
  zb_dtype_t grad_dtype;
  zb_tensor_list_t params; /* fp32 */
  zb_tensor_list_t grads;  /* same count and numels, grad_dtype */
  zb_tensor_list_t state1; /* AdamW exp_avg, SGD momentum buffer (count 0 for plain SGD), fp32 */
  zb_tensor_list_t state2; /* AdamW exp_avg_sq (count 0 for SGD), fp32 */
  float *undo;             /* NULL, or zb_optim_undo_bytes of backend memory */
} zb_optim_step_t;

ZB_API zb_status_t zb_optim_undo_bytes(const zb_optim_step_t *step, size_t *out);
ZB_API zb_status_t zb_optim_step(zb_backend_t *backend, const zb_optim_step_t *step);
/* Restores params and state from step->undo, as saved by zb_optim_step with the same lists. */
ZB_API zb_status_t zb_optim_undo(zb_backend_t *backend, const zb_optim_step_t *step);

/* ---- the W store ---------------------------------------------------------------------------
 * During B the split-backward layers push their weight-gradient work here instead of running it;
 * a W op pops the oldest group of its stage and runs it. Entries are plain data (no closures):
 *
 *   dw[out, in] += dy[rows, out]^T * x[rows, in]     (fp32 accumulation, beta = 1)
 *   db[out]     += sum over rows of dy                (when db is not NULL)
 *
 * x and dy are row-major: ldx/ldy is the distance between rows in elements, at least the row's
 * length (in_features, out_features), or ZB_LD_DENSE for rows stored back to back; anything else
 * fails the push. A broadcast row (a tensor stride of 0) is not a leading dimension: copy such
 * an input first, never pass its stride. Who frees them: the caller
 * keeps x and dy alive until the store hands back the entry's token through release_cb, which it
 * does exactly once per entry: after the GEMM has run (ran = 1) or when the entry is dropped
 * without running (ran = 0: zb_wstore_clear, zb_wstore_destroy, or a failed iteration). On the CUDA
 * backend "has run" means enqueued on the compute stream: memory freed then is safe to reuse in
 * that stream's order (cudaFree, or torch's caching allocator when x and dy were used on that
 * stream; otherwise record_stream them on it first). */
#define ZB_LD_DENSE 0 /* zb_wgrad_t.ldx/ldy: rows stored back to back */

typedef struct {
  uint32_t struct_size; /* sizeof(zb_wgrad_t) */
  zb_dtype_t dtype;     /* of x and dy */
  int64_t rows, in_features, out_features;
  const void *x;
  int64_t ldx; /* >= in_features, or ZB_LD_DENSE */
  const void *dy;
  int64_t ldy; /* >= out_features, or ZB_LD_DENSE */
  void *dw; /* [out_features, in_features], row-major, dense, in dw_dtype */
  void *db; /* [out_features] or NULL, in dw_dtype */
  uint64_t token; /* handed back to release_cb */
  /* Where the gradient goes. The default (zero-initialised) is Megatron's main_grad: dw and db are
   * fp32 and accumulate (beta = 1). dw_dtype may instead be the input dtype, for parameters whose
   * gradients are kept in bf16/f16 (the GEMM still sums in fp32 and rounds once to nearest-even);
   * overwrite = 1 writes dw = dy^T x and db = column sums instead of adding (beta = 0). An entry whose
   * struct_size ends before these fields gets the defaults. */
  zb_dtype_t dw_dtype; /* ZB_DTYPE_F32 or the same as dtype */
  int32_t overwrite;
} zb_wgrad_t;

/* Returns ZB_OK, or a status that fails the call that released the entry (pop_run, and so the W
 * op and the runner's iteration; clear; destroy) with the callback's status, naming the token. What
 * the caller does after a GEMM ran (adding a half-precision product into a gradient, say) is part
 * of that W, so its failure must not pass unseen. Every entry is still released exactly once. */
typedef zb_status_t (*zb_wgrad_release_cb)(void *user, uint64_t token, int32_t ran);

typedef struct zb_wstore zb_wstore_t;

/* The store runs its GEMMs on `backend` (borrowed; must outlive the store). release_cb may be NULL
 * when the caller does not track lifetimes. */
ZB_API zb_status_t zb_wstore_create(zb_wstore_t **out, zb_backend_t *backend,
                                    zb_wgrad_release_cb release_cb, void *release_user);
/* Drops what is still pending (release_cb with ran = 0) and frees the store, even when a release
 * callback failed (then its status is returned). NULL is a no-op. */
ZB_API zb_status_t zb_wstore_destroy(zb_wstore_t *store);
/* Opens the group that pushes go to: the W work of B(stage, mb). The runner does this around each
 * backward callback; call it yourself only when you drive the store without a runner. */
ZB_API zb_status_t zb_wstore_begin(zb_wstore_t *store, int32_t stage, int32_t mb);
/* Adds an entry to the open group (copied). Fails when no group is open, naming the call. */
ZB_API zb_status_t zb_wstore_push(zb_wstore_t *store, const zb_wgrad_t *entry);
ZB_API zb_status_t zb_wstore_end(zb_wstore_t *store);
/* Pops the oldest group of `stage` and runs its entries in push order on the backend's compute
 * stream (blocks on the host backend). *out_mb (may be NULL) gets the group's microbatch. Fails with
 * ZB_ERR_INVALID_SCHEDULE when the stage has no pending group. */
ZB_API zb_status_t zb_wstore_pop_run(zb_wstore_t *store, int32_t stage, int32_t *out_mb);
/* Groups still pending for a stage, or for all stages when stage < 0. */
ZB_API zb_status_t zb_wstore_pending(const zb_wstore_t *store, int32_t stage, int32_t *out_groups);
/* Drops every pending group (release_cb with ran = 0). */
ZB_API zb_status_t zb_wstore_clear(zb_wstore_t *store);

/* ---- transports ----------------------------------------------------------------------------
 * A transport moves one rank's bytes to and from its peers on numbered channels (tags). Each
 * (sender, receiver, tag) is a FIFO. Sends never wait for the receiver. A receive that gets nothing
 * within the caller's timeout fails with ZB_ERR_TIMEOUT naming the peer; a peer that aborted makes
 * it fail with ZB_ERR_REMOTE and the peer's message.
 *
 * In-process: the ranks are threads of one process sharing a group. After any rank aborts, the
 * group stays failed; make a new one for the next attempt. */
typedef struct zb_transport zb_transport_t;
typedef struct zb_inproc_group zb_inproc_group_t;

ZB_API zb_status_t zb_inproc_group_create(zb_inproc_group_t **out, int32_t ranks);
/* Fails with ZB_ERR_BUSY while transports of the group exist. NULL is a no-op. */
ZB_API zb_status_t zb_inproc_group_destroy(zb_inproc_group_t *group);
/* With a CUDA backend (several ranks on one GPU) the messages travel device to device: each send and
 * receive copies on the rank's compute stream and waits for it (slow, exact; for tests and
 * benchmarks). Undelivered device messages are freed with the sender's backend when the group is
 * destroyed, so destroy the group before the backends. A transport carries the buffers of the
 * backend of the first runner created on it, and refuses runners on another backend. */
ZB_API zb_status_t zb_transport_create_inproc(zb_transport_t **out, zb_inproc_group_t *group,
                                              int32_t rank);

/* Callback transport: the binding supplies non-blocking send/recv (e.g. torch.distributed.isend and
 * irecv over gloo). Each start call that succeeds returns an opaque request handle; the library
 * passes every such handle exactly once either to wait_cb (which completes it) or, when it gives up
 * after an error, to cancel_cb. A start call that fails hands nothing over: it frees what it made. wait_cb(timeout_s = 0) must not block: it returns ZB_ERR_TIMEOUT when the request is
 * not done yet. wait_cb returns ZB_ERR_TIMEOUT when the time runs out, ZB_ERR_REMOTE when the peer
 * is known to be gone, anything else for its own failures. abort_cb (may be NULL) tells the peers
 * that this rank failed. The callbacks run on the thread that called into the library. Buffers are
 * host memory: a runner on the CUDA backend refuses this transport (use the NCCL or the in-process
 * transport there). */
typedef struct {
  uint32_t struct_size; /* sizeof(zb_transport_callbacks_t) */
  void *user;
  zb_status_t (*isend_cb)(void *user, int32_t peer, int32_t tag, const void *buf, size_t bytes,
                          void **request);
  zb_status_t (*irecv_cb)(void *user, int32_t peer, int32_t tag, void *buf, size_t bytes,
                          void **request);
  zb_status_t (*wait_cb)(void *user, void *request, double timeout_s);
  void (*cancel_cb)(void *user, void *request);
  void (*abort_cb)(void *user, const char *reason);
} zb_transport_callbacks_t;

ZB_API zb_status_t zb_transport_create_callback(zb_transport_t **out,
                                                const zb_transport_callbacks_t *callbacks,
                                                int32_t rank, int32_t ranks);
/* NCCL transport: moves the CUDA backend's device buffers between ranks, one process (and GPU) per
 * rank. Each pair of ranks that exchange data gets one two-rank communicator and one stream (a rank
 * has one per neighbour: one or two), non-blocking and split (ncclCommSplit with splitShare) from
 * one parent made from `unique_id`, or from the borrowed `comm`. NCCL runs a communicator's
 * operations in order, so both ranks of a pair issue their traffic (activations one way, gradients
 * the other, several boundaries under V or interleaved placement) in one order computed from the
 * schedule: a transfer's place is the simulated start of the op that consumes it. The runner may
 * post in its own order; a request whose turn has not come waits on the host and goes out, grouped
 * with the ones ready after it, once the ones before it are posted. A runner created on the
 * transport sets the order from its schedule (a schedule that needs a pair of ranks the transport
 * has no communicator for is refused). Ops run as pairs (zb_runner_config_t.pair_first) are not
 * supported on this transport.
 *
 * Work is ordered on the device: a send waits for the compute stream's work issued before it, the
 * compute stream waits for a receive with an event, and the host only blocks at the end of an
 * iteration (for sends to leave). A watchdog thread checks ncclCommGetAsyncError and the age of
 * each pair's oldest unfinished transfer, counted from when it became ready on the device (a send:
 * the work producing its data done; a receive: the compute stream reached the op that needs it),
 * not from when the host issued it: timeout_s bounds one stall, however far the host runs ahead. It
 * holds no lock while the host enqueues CUDA or NCCL work, so it fires even when a dead peer has
 * filled a launch queue and the host is blocked inside an enqueue. After timeout_s (or on an NCCL
 * error) it aborts the communicators (ncclCommAbort), so stuck kernels return, and the runner
 * fails naming the peer and the channel. An aborted transport stays failed; make a new one (and a
 * new unique id) for the next attempt. Every message of an iteration has its request (three CUDA
 * events) made when the order is set, so nothing is created inside an iteration.
 *
 * NCCL's abort is local. With `abort_signal` set, a failure also reaches every other rank: the
 * rank that fails first publishes its message, and every rank's watchdog polls the signal (every
 * 0.2 s) and fails its transport with ZB_ERR_REMOTE and that message (the Python binding uses the
 * job's c10d store). Without it, the peers of a failed rank fail at their timeout.
 *
 * With `unique_id`, creation is bounded: it fails with ZB_ERR_TIMEOUT after timeout_s when some
 * rank does not call zb_transport_create_nccl (a split of a borrowed blocking `comm` is bounded by
 * that communicator only).
 *
 * The transport only carries the runner's channels: zb_optimizer and zb_postval exchange host
 * memory, so give them a host transport (the callback transport over a torch.distributed gloo
 * group, as the Python binding does). zb_transport_create_nccl blocks until every rank has called
 * it (it creates communicators collectively); every rank passes the same schedule. */
#define ZB_NCCL_UNIQUE_ID_BYTES 128
#define ZB_NCCL_TRANSPORT_CONFIG_VERSION 1

/* A fresh ncclUniqueId (ncclGetUniqueId), to make on one rank and broadcast to all. */
ZB_API zb_status_t zb_nccl_unique_id(uint8_t out[ZB_NCCL_UNIQUE_ID_BYTES]);

/* An out-of-band channel that tells every rank of a job that one rank failed (a key in a shared
 * store, a file, ...). Both functions are called from the library's threads (the watchdog's, or
 * the one that failed) with no lock of the library held, and must not block for long. */
typedef struct {
  /* Nonzero once some rank has published a failure; its message goes into msg (cap bytes, NUL
   * terminated). */
  int (*poll)(void *user, char *msg, size_t cap);
  /* Tells the other ranks this rank failed with msg; called once, by the rank's first failure that
   * did not come from the signal itself. The first message published should win. */
  void (*publish)(void *user, const char *msg);
  void *user;
} zb_abort_signal_t;

typedef struct {
  uint32_t struct_size; /* sizeof(zb_nccl_transport_config_t); the size before abort_signal is
                         * accepted too (no signal) */
  uint32_t version;     /* ZB_NCCL_TRANSPORT_CONFIG_VERSION */
  int32_t rank, ranks;
  const uint8_t *unique_id; /* ZB_NCCL_UNIQUE_ID_BYTES, the same on every rank; NULL with comm */
  void *comm;               /* an ncclComm_t over the same ranks to split from (borrowed), or NULL */
  zb_backend_t *backend;    /* the rank's CUDA backend (the transport holds a reference) */
  const zb_schedule_t *schedule; /* decides the channels; read during the call only */
  double timeout_s;         /* longest one transfer may take once ready, and creation; <= 0: 300 s */
  zb_abort_signal_t abort_signal; /* optional (all NULL: failures stay local) */
} zb_nccl_transport_config_t;

#define ZB_NCCL_TRANSPORT_CONFIG_INIT                                                              \
  { sizeof(zb_nccl_transport_config_t), ZB_NCCL_TRANSPORT_CONFIG_VERSION, 0, 1, NULL, NULL, NULL, NULL, 0.0, \
    {NULL, NULL, NULL} }

ZB_API zb_status_t zb_transport_create_nccl(zb_transport_t **out, const zb_nccl_transport_config_t *config);

/* NCCL group transport: collectives over every rank of a group on device memory
 * (zb_transport_all_reduce, zb_transport_broadcast; no point-to-point messages), for Vocabulary
 * Parallelism's passes when each rank has a GPU of its own. One communicator over the group and a
 * stream of its own: a collective is ncclAllReduce or ncclBroadcast in place, after the work the
 * backend's stream was given before the call, and the call returns when it has finished on the
 * device (blocking, as the host transports' collectives). NCCL adds in its own order: a SUM equals
 * the host transports' rank-order sum within floating-point rounding, not bit for bit (the same on
 * every rank); broadcasts are exact; MAX is fmaxf's (a NaN is dropped unless every rank has one,
 * where the host transports keep it). Every rank calls one transport's collectives in one
 * order, whatever their channels (one NCCL queue per communicator: give each independent kind of
 * collective a transport of its own); one thread at a time per transport.
 *
 * Failures: each collective waits at most timeout_s (<= 0: 300 s) for this rank's data to be ready
 * on the device, and as long again from then for the collective; a timeout, an NCCL error, the abort signal or zb_transport_abort (from any
 * thread) aborts the communicator, and the transport stays failed (make a new one, with a new
 * unique id). Creation blocks until every rank has called it, at most timeout_s. The backend
 * (held by the transport) gives the device and the stream the collectives follow. */
#define ZB_NCCL_GROUP_CONFIG_VERSION 1

typedef struct {
  uint32_t struct_size; /* sizeof(zb_nccl_group_config_t) */
  uint32_t version;     /* ZB_NCCL_GROUP_CONFIG_VERSION */
  int32_t rank, ranks;
  const uint8_t *unique_id; /* ZB_NCCL_UNIQUE_ID_BYTES from zb_nccl_unique_id, the same on every rank */
  zb_backend_t *backend;    /* the rank's CUDA backend */
  double timeout_s;
  zb_abort_signal_t abort_signal; /* optional (all NULL: failures stay local) */
} zb_nccl_group_config_t;

#define ZB_NCCL_GROUP_CONFIG_INIT                                                                  \
  { sizeof(zb_nccl_group_config_t), ZB_NCCL_GROUP_CONFIG_VERSION, 0, 1, NULL, NULL, 0.0, {NULL, NULL, NULL} }

ZB_API zb_status_t zb_transport_create_nccl_group(zb_transport_t **out, const zb_nccl_group_config_t *config);

/* Socket transport: host memory between processes over connected stream sockets (AF_UNIX or TCP),
 * one per peer, which the caller connects and hands over (the Python binding does this for a
 * torch.distributed group through the job's c10d store). A progress thread per transport writes
 * queued sends and reads each message into its posted receive, or into a staging buffer until
 * the receive is posted, so sends never wait for the receiver even when two ranks send each other
 * large messages at once. Messages carry their channel and size and are matched in order per
 * (peer, channel). A receive of another size than the message fails with ZB_ERR_INVALID_ARGUMENT.
 *
 * Failures: a peer whose connection ends (its process died or closed its transport) fails the
 * waits on that peer at once with ZB_ERR_REMOTE naming the peer and the channel (messages that
 * came before stay deliverable). zb_transport_abort sends the reason to every connected peer,
 * whose waits then all fail with ZB_ERR_REMOTE and that reason. With `abort_signal` set, a wait
 * that blocks polls it every 0.2 s (on the waiting thread) and the first failure of this rank's own
 * is published on it, so ranks without a connection to the failed one hear of it too. Buffers
 * are host memory: a runner on the CUDA backend refuses this transport. */
#define ZB_SOCKET_TRANSPORT_CONFIG_VERSION 1

typedef struct {
  uint32_t struct_size; /* sizeof(zb_socket_transport_config_t) */
  uint32_t version;     /* ZB_SOCKET_TRANSPORT_CONFIG_VERSION */
  int32_t rank, ranks;
  /* `ranks` entries: fds[r] a connected stream socket to rank r, -1 for this rank and for ranks it
   * never exchanges messages with; NULL: none yet (zb_transport_socket_attach gives them later).
   * Read during the call; from the call on, the transport owns the sockets (made non-blocking,
   * closed by zb_transport_destroy, or before the call returns when it fails after reading a valid
   * struct_size and version). */
  const int32_t *fds;
  zb_abort_signal_t abort_signal; /* optional (all NULL: failures travel over the sockets only) */
} zb_socket_transport_config_t;

#define ZB_SOCKET_TRANSPORT_CONFIG_INIT                                                            \
  { sizeof(zb_socket_transport_config_t), ZB_SOCKET_TRANSPORT_CONFIG_VERSION, 0, 1, NULL, {NULL, NULL, NULL} }

/* Does not block (no handshake: the caller's sockets are connected already). */
ZB_API zb_status_t zb_transport_create_socket(zb_transport_t **out, const zb_socket_transport_config_t *config);
/* Gives a socket transport the sockets of peers it has none for yet (`ranks` entries as in the
 * config, -1 where nothing changes), so that a transport can be made (and handed to a runner or
 * an optimizer) before the ranks connect. Owns them from the call on, as the config's. A transfer
 * with a peer that has no socket fails with ZB_ERR_INVALID_ARGUMENT naming it. Not while another
 * thread uses the transport. */
ZB_API zb_status_t zb_transport_socket_attach(zb_transport_t *transport, const int32_t *fds);

/* A transport for any backend's buffers over a host-memory transport (`inner`: the socket or the
 * callback transport), staged through host memory: a send copies its buffer to the host on the
 * backend's compute stream, waits for that copy and sends it; a receive lands on the host and is
 * copied into the runner's buffer when it is waited on. For ranks that share a GPU, which NCCL
 * refuses (two ranks of a communicator on one GPU); one GPU per rank with NCCL is the fast path.
 * Ranks, failures, abort and timeouts are the inner transport's. `inner` must outlive it (its
 * zb_transport_destroy is ZB_ERR_BUSY until this one is destroyed) and may keep serving other
 * channels (the optimizer's) directly. ZB_ERR_INVALID_ARGUMENT for an inner transport that does not
 * move host memory (NCCL, in-process). */
ZB_API zb_status_t zb_transport_create_staged(zb_transport_t **out, zb_transport_t *inner);

/* Tells the peers that this rank failed (their pending and later receives from it fail with
 * ZB_ERR_REMOTE and `reason`). A runner does this itself when an iteration fails. */
ZB_API zb_status_t zb_transport_abort(zb_transport_t *transport, const char *reason);
/* Fails with ZB_ERR_BUSY, and frees nothing, while a runner or post-validation handle (zb_postval,
 * zb_optimizer) created on it still exists. NULL is a no-op. */
ZB_API zb_status_t zb_transport_destroy(zb_transport_t *transport);

/* Collectives over every rank of the transport's group (Vocabulary Parallelism's all-reduces and
 * broadcasts across the pipeline), blocking; every rank calls them in the same order, and not
 * while a runner of the transport is inside an iteration on another thread. They travel as the
 * transport's own messages on a channel of their own, through rank 0: it receives every rank's
 * buffer, reduces them in rank order, ((x0 op x1) op x2) ..., each step rounded to the dtype, and
 * sends the result to every rank, so the bits are the same on every rank, transport and run. A
 * broadcast goes from the root to each rank. p - 1 messages each way: for per-token statistics and
 * hidden-sized tensors, not for a model's gradients. timeout_s (<= 0: 300 s; the NCCL group
 * transport ignores it and uses its config's timeout_s) bounds each message: a
 * rank that does not join fails the others at their timeout, naming it; one that aborted, at once
 * (ZB_ERR_REMOTE). MAX keeps NaNs. Host memory: the in-process (on a host backend), callback,
 * socket and staged transports; the NCCL pair transport is refused (ZB_ERR_UNSUPPORTED). Device
 * memory: the NCCL group transport (zb_transport_create_nccl_group), with NCCL's own collectives. */
typedef enum {
  ZB_REDUCE_SUM = 0,
  ZB_REDUCE_MAX = 1,
} zb_reduce_op_t;

/* channel (0 .. 1023): collectives of one channel pair up in the order each rank calls them;
 * different channels do not wait for each other's order (Vocabulary Parallelism's S, T, IF and IB
 * passes each use their own, so that each kind only has to run in microbatch order). */
#define ZB_COLLECTIVE_CHANNELS 1024

ZB_API zb_status_t zb_transport_all_reduce(zb_transport_t *transport, int32_t channel, void *buf, size_t count,
                                           zb_dtype_t dtype, zb_reduce_op_t op, double timeout_s);
ZB_API zb_status_t zb_transport_broadcast(zb_transport_t *transport, int32_t channel, void *buf, size_t bytes,
                                          int32_t root, double timeout_s);

/* ---- the runner ----------------------------------------------------------------------------
 * Executes one rank's op list for one iteration. F and B call back into the caller's model:
 *
 *   forward_cb(user, stage, mb, input, output): input holds the activation from stage-1 (NULL on
 *     stage 0: the model reads its own data); write the activation for stage+1 into output (NULL on
 *     the last stage, which computes the loss).
 *   backward_cb(user, stage, mb, grad_output, grad_input): grad_output holds the gradient from
 *     stage+1 (NULL on the last stage); write the gradient for this stage's input into grad_input
 *     (NULL on stage 0). Push weight-gradient work into the runner's W store instead of running it.
 *
 * Both buffers are valid only during the call; copy what the model keeps. A nonzero status from a
 * callback fails the iteration (its zb_last_error text, if it set one, is kept in the message).
 * A W op pops the stage's oldest W-store group; a BW op runs B and then pops. Sends start as soon as
 * the producing op returns; receives are posted recv_depth ahead of the op that needs them.
 *
 * Memory: zb_runner_create allocates every message buffer the runner will use, per channel, as
 * many as the op lists allow in flight at once (a happens-before count over all ranks' lists: a
 * send's buffer is free once the receiver's op has consumed it), and recycles them per channel.
 * No iteration allocates or frees backend memory (cudaMalloc/cudaFree on CUDA) as long as the
 * transport completes a send no later than its receive, which every transport here does. */
typedef zb_status_t (*zb_forward_cb)(void *user, int32_t stage, int32_t mb, const void *input,
                                     void *output);
typedef zb_status_t (*zb_backward_cb)(void *user, int32_t stage, int32_t mb,
                                      const void *grad_output, void *grad_input);
/* PipeOffload's copies (see copy_cb below): type is ZB_OP_OFFLOAD or ZB_OP_RELOAD. */
typedef zb_status_t (*zb_copy_cb)(void *user, int32_t type, int32_t stage, int32_t mb);
/* Vocabulary Parallelism's passes (see vocab_cb below): type is ZB_OP_S, ZB_OP_T, ZB_OP_IF or ZB_OP_IB. */
typedef zb_status_t (*zb_vocab_cb)(void *user, int32_t type, int32_t mb);

#define ZB_RUNNER_CONFIG_VERSION 1

typedef struct {
  uint32_t struct_size;
  uint32_t version;
  int32_t rank;
  const zb_schedule_t *schedule; /* borrowed; must outlive the runner and stay unchanged */
  zb_backend_t *backend;         /* borrowed */
  zb_transport_t *transport;     /* borrowed; may be NULL when the schedule has one rank */
  zb_wstore_t *wstore;           /* borrowed */
  /* Bytes of the activation that stage s sends to stage s+1 (the gradient back is the same size),
   * S-1 values, copied. NULL: every boundary is boundary_bytes_all. */
  const int64_t *boundary_bytes;
  int64_t boundary_bytes_all;
  zb_forward_cb forward_cb;
  zb_backward_cb backward_cb;
  void *user;
  double timeout_s;   /* longest wait for one message; <= 0: 300 s */
  int32_t recv_depth; /* receives posted ahead; <= 0: 4 */
  /* Ops that run as one unit (torch's OVERLAP_F_B, for a caller that overlaps the two itself):
   * pair_first[j] = k makes ops k and k+1 of this rank's list a pair, n_pairs entries, copied.
   * A pair waits for both ops' inputs before its first callback, calls both callbacks back to
   * back, and sends both outputs after the second: the caller may compute the two in any order,
   * or together, inside the second callback. The second op must not take its input from the
   * first. A schedule whose order needs the first op's output to leave before the second op's
   * input can arrive deadlocks (ends in a timeout): DualPipeV's pairs do not. Callers whose
   * struct_size ends before these fields get no pairs. */
  const int32_t *pair_first;
  int32_t n_pairs;
  /* Where the runner's message buffers come from: alloc_cb(alloc_user, bytes, &ptr) at
   * zb_runner_create (and only there, unless the buffer plan fell short), free_cb(alloc_user, ptr)
   * at zb_runner_destroy. Memory the backend can use: device memory of its device on CUDA (for
   * example torch's caching allocator, on the stream the runner runs on). NULL: the backend's own
   * (zb_backend_alloc). Both or neither. */
  zb_status_t (*alloc_cb)(void *alloc_user, size_t bytes, void **out);
  void (*free_cb)(void *alloc_user, void *ptr);
  void *alloc_user;
  /* Zero-copy stages. With release_cb set, the runner keeps no buffer for an op's output:
   * forward_cb and backward_cb get output == NULL (grad_input == NULL) and hand over their own
   * buffer, holding the output laid out as the boundary's bytes, with zb_runner_lend_output during
   * the call. The runner sends from it (or gives it to the op of this rank that takes it as input)
   * and calls release_cb(user, token) once nothing reads it any more: its send finished, or its
   * consumer's inputs were let go (below). Until then the caller keeps it alive and unchanged. In
   * the same mode an op's input stays valid after its callback: the inputs of F(s, mb) and B(s, mb)
   * until W(s, mb) or BW(s, mb) has run, or until the iteration ends, which is as long as autograd
   * keeps a stage's input and output gradient for its weight gradient; so the caller copies
   * nothing. The buffer plan counts those receive buffers. Not with pair_first. Callers whose
   * struct_size ends before this field get the copying mode. */
  void (*release_cb)(void *user, uint64_t token);
  /* PipeOffload's copies: a schedule with OFFLOAD/RELOAD ops (zb_schedule_plan_offload) runs them
   * on the rank's copy lane. Just before the runner runs a compute op it issues the copies that
   * follow that op in the list; copy_cb(user, type, stage, mb) then moves what F(stage, mb) saved
   * for its backward to host memory (ZB_OP_OFFLOAD) or back (ZB_OP_RELOAD). On the host backend a
   * thread of the runner calls it, one copy at a time in list order, an OFFLOAD only after its F
   * has returned, and the B/BW and W of an offloaded (stage, mb) wait for its RELOAD (at most
   * timeout_s); with copy_time_scale > 0 each copy lasts at least its schedule time (T_OFFLOAD,
   * T_RELOAD) times copy_time_scale seconds, a modelled link. On a device backend copy_cb is called
   * on the runner's thread when the copy is issued and must only enqueue it, ordered against the
   * compute stream by the caller (a copy stream and events); the runner issues it just after the
   * op before it has been enqueued, so an OFFLOAD right after its F finds the F's tensors. A failing copy fails the iteration,
   * named. NULL: copies move nothing and only take their modelled time. Callers whose struct_size
   * ends before these fields cannot run schedules with copies. */
  zb_copy_cb copy_cb;
  double copy_time_scale;
  /* 1: on the host backend too, copy_cb is called on the runner's thread, and the copy is done
   * when it returns (no copy thread, no modelled time), in list order: of the copies after a
   * compute op, those before the first OFFLOAD just before that op (RELOADs, where the model starts
   * them), the rest just after it. For a caller whose callbacks must not run at the same time as
   * each other (Python's, under its interpreter lock). */
  int32_t copy_inline;
  /* Vocabulary Parallelism's passes: a schedule with S, T, IF and IB ops (spec `vocab`) calls
   * vocab_cb(user, type, mb) at each, on the runner's thread, between the ops before and after it
   * in the list, like forward_cb. The caller does the pass and starts its collectives (the
   * barriers of the schedule model: zb_transport_all_reduce / zb_transport_broadcast over the
   * pipeline group, a channel per kind of pass; zbpp.vocab in Python), and whatever needs a result
   * waits for it: T for S's, stage 0's forward for IF's, the last stage's backward for the output
   * layer's input gradient. As the model has them, the collectives run beside the compute, each
   * kind in microbatch order on a lane of its own (a thread or stream and a transport each, as
   * benchmarks/bench_vocab.py does): the ranks run the kinds of passes in different orders among
   * themselves, so a pass that blocked on its collective could wait for a rank that waits in
   * another kind's. A failing pass fails the iteration, named. Callers whose struct_size ends
   * before this field, or that leave it NULL, cannot run schedules with these passes. */
  zb_vocab_cb vocab_cb;
} zb_runner_config_t;

#define ZB_RUNNER_CONFIG_INIT                                                                      \
  {                                                                                                \
    sizeof(zb_runner_config_t), ZB_RUNNER_CONFIG_VERSION, 0, NULL, NULL, NULL, NULL, NULL, 0,      \
        NULL, NULL, NULL, 0.0, 0, NULL, 0, NULL, NULL, NULL, NULL, NULL, 0.0, 0, NULL              \
  }

typedef struct zb_runner zb_runner_t;

ZB_API zb_status_t zb_runner_create(zb_runner_t **out, const zb_runner_config_t *config);
/* Runs one iteration; blocks until this rank's ops are done and its sends have left. At the end the
 * W store must be empty and every channel drained, or the call fails. On failure the runner aborts
 * its transport so the peers fail too (naming this rank, its op and microbatch), drops what is left
 * in the W store, and the message says which op failed and why. */
ZB_API zb_status_t zb_runner_run(zb_runner_t *runner);
/* Inside a forward_cb or backward_cb of a runner made with release_cb: this op's output is in buf
 * (the caller's backend memory, the boundary's size; NULL only for a boundary of 0 bytes), to be
 * released with `token` through release_cb. Fails with ZB_ERR_INVALID_ARGUMENT outside such a
 * call, for an op without an output, or a second time for one op. Does not block. */
ZB_API zb_status_t zb_runner_lend_output(zb_runner_t *runner, void *buf, uint64_t token);
/* The last iteration's op times, aligned with zb_schedule_rank_ops (seconds, CLOCK_MONOTONIC).
 * On the CUDA backend they are device times (events around each op's work on the compute stream,
 * counted from the iteration's start on the host clock), since the host only issues the work.
 * Valid until the next zb_runner_run or zb_runner_destroy. */
ZB_API zb_status_t zb_runner_times(const zb_runner_t *runner, const double **start,
                                   const double **end, int32_t *count);
ZB_API zb_status_t zb_runner_destroy(zb_runner_t *runner);

/* ---- the optimizer and post-validation (the paper's section 4) -------------------------------
 * AdamW or SGD over fp32 parameters, with gradient clipping by global norm and a dynamic loss
 * scale. With post_validation = 0 each step first reduces the global state (squared norms and
 * inf/NaN flags of every stage) across the ranks, then steps: the synchronous reference. With
 * post_validation = 1 a rank steps at once with the partial state it received from the ranks before
 * it, passes its own state on, and checks the step when the full state comes back: if inf/NaN turns
 * up anywhere it undoes the step exactly and skips it (and the loss scale backs off); if clipping
 * turns out to need another factor it undoes the step and redoes it with the right one. The final
 * parameters are bit-for-bit those of the synchronous path.
 *
 * The global state is exchanged as the whole per-stage vector and the norm always summed over the
 * stages in stage order, so the result is the same whatever the partition of stages over ranks
 * (one rank holding every stage included).
 *
 * Memory: post-validation keeps a copy of what one step changes, to undo it exactly: the parameters
 * and the optimizer state (SGD: 2 fp32 values per parameter with momentum, 1 without; AdamW: 3).
 * Only ranks that step speculatively hold it (not the last rank of the chain), allocated once at
 * the first step; the optimizer state itself (AdamW: 2 values per parameter, SGD with momentum: 1)
 * is also allocated then. */

#define ZB_OPTIMIZER_CONFIG_VERSION 1

typedef struct {
  uint32_t struct_size;
  uint32_t version;
  zb_optim_kind_t kind;
  double lr;
  double momentum;     /* SGD */
  double beta1, beta2; /* AdamW */
  double eps;          /* AdamW */
  double weight_decay; /* decoupled for AdamW, added to the gradient for SGD (as torch does) */
  double clip_grad;    /* max global L2 norm of the unscaled gradients; <= 0: no clipping */
  /* Dynamic loss scale: gradients arrive multiplied by it. On inf/NaN the step is skipped and the
   * scale multiplied by backoff; after growth_interval good steps in a row it is multiplied by
   * growth (0: never grows). 1.0 with no growth means no scaling. */
  double loss_scale, backoff, growth;
  int32_t growth_interval;
  int32_t post_validation;
  /* The pipeline: stages S in all; this rank among ranks, and the transport to reach the others
   * (NULL when ranks == 1). placement decides the order the partial state travels in: toward the
   * rank holding the last stage (rank 0 -> p-1 in a loop, p-1 -> 0 in a V). */
  int32_t stages, rank, ranks;
  zb_placement_t placement;
  zb_transport_t *transport;
  double timeout_s; /* <= 0: 300 s */
} zb_optimizer_config_t;

#define ZB_OPTIMIZER_CONFIG_INIT                                                                   \
  {                                                                                                \
    sizeof(zb_optimizer_config_t), ZB_OPTIMIZER_CONFIG_VERSION, ZB_OPTIM_ADAMW, 1e-3, 0.0, 0.9,    \
        0.999, 1e-8, 0.0, 0.0, 1.0, 0.5, 2.0, 0, 0, 1, 0, 1, ZB_PLACEMENT_LOOP, NULL, 0.0          \
  }

typedef struct {
  int32_t skipped;     /* inf/NaN somewhere: no parameter changed */
  int32_t clipped;     /* the gradients were scaled down to clip_grad */
  int32_t rolled_back; /* this rank undid a speculative step (post-validation only) */
  double grad_norm;    /* global L2 norm of the unscaled gradients (inf when skipped) */
  double loss_scale;   /* the scale for the next iteration */
} zb_step_result_t;

typedef struct zb_optimizer zb_optimizer_t;

ZB_API zb_status_t zb_optimizer_create(zb_optimizer_t **out, const zb_optimizer_config_t *config);
/* Registers numel parameters of `stage` (one of this rank's) and their gradients; both fp32 host
 * arrays, borrowed for the optimizer's lifetime. Order matters only for reproducibility. Register
 * everything before the first zb_optimizer_step; later calls fail. */
ZB_API zb_status_t zb_optimizer_add(zb_optimizer_t *opt, int32_t stage, float *param,
                                    const float *grad, int64_t numel);
/* One step. Every rank calls it once per iteration, after its runner finished; it blocks for the
 * exchange with the other ranks (post-validation: only for the full state coming back). Gradients
 * are read, not changed. On failure (ZB_ERR_TIMEOUT, ZB_ERR_REMOTE, ...) the message names this
 * rank, the phase and the peer, and this rank's parameters, optimizer state and loss scale are as
 * before the call; other ranks may have stepped, and the channels may hold a stale message, so treat
 * it like a failed iteration. The optimizer does not abort the transport: call zb_transport_abort
 * to make the peers fail at once instead of at their timeout. */
ZB_API zb_status_t zb_optimizer_step(zb_optimizer_t *opt, zb_step_result_t *out);
ZB_API zb_status_t zb_optimizer_loss_scale(const zb_optimizer_t *opt, double *out);
ZB_API zb_status_t zb_optimizer_destroy(zb_optimizer_t *opt);

/* ---- post-validation for an optimizer the caller runs --------------------------------------
 * The exchange and the decision of zb_optimizer_step on their own, for an optimizer the caller
 * steps itself (torch.optim.AdamW or SGD from the Python binding, a fused device optimizer). The
 * handle passes the global state (per stage: the squared norm of the gradients and an inf/NaN flag)
 * along the chain of ranks and decides, exactly as zb_optimizer does: skip on inf/NaN, the clipping
 * coefficient (torch's clip_grad_norm_), the dynamic loss scale (torch's GradScaler). The caller
 * keeps the undo copy, steps and undoes when told. zb_optimizer_step is built on this handle, so
 * the two give the same decisions bit for bit on the same gradients.
 *
 * One iteration, on every rank, after its runner finished:
 *  1. For each of this rank's stages s compute sq_norms[s], the sum of the squares of all the
 *     stage's gradient elements as they are (still multiplied by the loss scale), accumulated in
 *     double, and nonfinite[s], nonzero when any of them is inf or NaN. For the same bits as
 *     zb_optimizer, use one double accumulator per stage over its arrays in a fixed order.
 *  2. zb_postval_begin(pv, sq_norms, nonfinite, &d): blocks until the partial state arrives from
 *     the rank before this one in the chain (none for the first), adds this rank's stages, sends it
 *     on and posts the receive of the full state.
 *  3. If d.step: save a copy of everything a step changes (parameters, optimizer state and step
 *     count), then step with every gradient element multiplied by d.factor (a float; multiply in
 *     fp32). d.step is only ever set on a rank with post_validation = 1 that is not the chain's
 *     last, when nothing before it had inf/NaN.
 *  4. zb_postval_end(pv, &d): blocks until the full state comes back from the next rank (none for
 *     the last), passes it back to the previous one and decides.
 *  5. If d.undo: restore the copy from step 3. Then, if d.step: step with the gradients multiplied
 *     by d.factor. The redo needs the gradients as they were in step 1: if step 3 scaled them in
 *     place, keep them in the copy too. d.skipped, d.clipped, d.grad_norm and d.loss_scale report
 *     the iteration; multiply the next iteration's loss by d.loss_scale.
 * With post_validation = 0 no rank is told to step in begin: every rank steps after end, with the
 * full state, as the synchronous reference. With ranks == 1 nothing is exchanged.
 *
 * The chain runs toward the rank holding the last stage (rank 0 -> p-1 in a loop, p-1 -> 0 in a
 * V); the messages use the same channels (tags) as zb_optimizer, so a pipeline must not run both on
 * one transport at once.
 *
 * Failures: when begin or end fails (ZB_ERR_TIMEOUT, ZB_ERR_REMOTE, ...) the message names this
 * rank, the phase and the peer; the pending requests are cancelled, the loss scale is unchanged and
 * the handle is ready for the next zb_postval_begin. If end fails after begin told the caller to
 * step, d.undo is 1 (and d.step 0): restore the copy, so this rank is as before the iteration.
 * Other ranks may have stepped and a channel may hold a stale message, so treat it like a failed
 * iteration (zb_transport_abort makes the peers fail at once instead of at their timeout). Calls
 * out of order fail with a message saying so: end without begin (ZB_ERR_INVALID_ARGUMENT), begin
 * twice or destroy between begin and end (ZB_ERR_BUSY; the transport may still write into the
 * handle's buffers, so call end first: it returns within the timeout). */
#define ZB_POSTVAL_CONFIG_VERSION 1

typedef struct {
  uint32_t struct_size; /* sizeof(zb_postval_config_t) as the caller compiled it */
  uint32_t version;     /* ZB_POSTVAL_CONFIG_VERSION */
  double clip_grad;     /* max global L2 norm of the unscaled gradients; <= 0: no clipping */
  /* The dynamic loss scale, as in zb_optimizer_config_t: the gradients arrive multiplied by it; on
   * inf/NaN it is multiplied by backoff, after growth_interval good steps in a row by growth (0:
   * never grows). */
  double loss_scale, backoff, growth;
  int32_t growth_interval;
  int32_t post_validation; /* 0: exchange first, then decide (the synchronous path); 1: speculate */
  /* The pipeline, as in zb_optimizer_config_t: S stages placed over ranks; this rank. */
  int32_t stages, rank, ranks;
  zb_placement_t placement;
  zb_transport_t *transport; /* borrowed, must outlive the handle; NULL when ranks == 1 */
  double timeout_s;          /* longest wait for one message; <= 0: 300 s */
} zb_postval_config_t;

#define ZB_POSTVAL_CONFIG_INIT                                                                     \
  {                                                                                                \
    sizeof(zb_postval_config_t), ZB_POSTVAL_CONFIG_VERSION, 0.0, 1.0, 0.5, 2.0, 0, 0, 1, 0, 1,     \
        ZB_PLACEMENT_LOOP, NULL, 0.0                                                               \
  }

/* What the caller does now. Written by zb_postval_begin (step, factor and loss_scale, the scale the
 * current gradients carry; the rest 0) and by zb_postval_end (every field), on failure too. */
typedef struct {
  int32_t step;      /* 1: step now, with every gradient element multiplied by factor */
  int32_t undo;      /* end only: first undo the speculative step made after begin */
  float factor;      /* 1/loss_scale times the clipping coefficient, as a float (0 when step is 0
                        after begin, or when skipped) */
  int32_t skipped;   /* end: inf/NaN somewhere, no step this iteration */
  int32_t clipped;   /* end: factor includes a clipping coefficient < 1 */
  double grad_norm;  /* end: global L2 norm of the unscaled gradients (inf when skipped) */
  double loss_scale; /* end: the scale for the next iteration */
} zb_postval_decision_t;

typedef struct zb_postval zb_postval_t; /* opaque */

/* The config is copied; the transport stays borrowed. Fails with ZB_ERR_INVALID_ARGUMENT (the same
 * rules and messages as zb_optimizer_create's) and *out NULL. */
ZB_API zb_status_t zb_postval_create(zb_postval_t **out, const zb_postval_config_t *config);
/* NULL is a no-op. ZB_ERR_BUSY between zb_postval_begin and zb_postval_end. */
ZB_API zb_status_t zb_postval_destroy(zb_postval_t *pv);
/* Steps 1-2 above. sq_norms and nonfinite point at `stages` values each, of which only this rank's
 * stages are read (during the call; nothing is kept). A sq_norms value that is inf or NaN counts as
 * nonfinite; a negative one is an invalid argument. Blocks for the partial state from the previous
 * rank (up to timeout_s); sends never wait. out->step = 1 when the caller must step speculatively
 * now (post_validation on, not the chain's last rank, the partial state free of inf/NaN). */
ZB_API zb_status_t zb_postval_begin(zb_postval_t *pv, const double *sq_norms,
                                    const int32_t *nonfinite, zb_postval_decision_t *out);
/* Steps 4-5 above. Blocks for the full state from the next rank (up to timeout_s), passes it back,
 * decides and updates the loss scale: out->undo when the speculative step must be undone (the full
 * state has inf/NaN, or the clipping factor differs), out->step when the caller must step now
 * (after any undo) with out->factor. On failure out->undo = 1 if the caller stepped after begin.
 * With out NULL it fails and the handle stays begun. */
ZB_API zb_status_t zb_postval_end(zb_postval_t *pv, zb_postval_decision_t *out);
/* The scale the current gradients must carry (the loss multiplied by it); changes only in end. */
ZB_API zb_status_t zb_postval_loss_scale(const zb_postval_t *pv, double *out);

/* Checkpoints. What a resumed run needs so that its handle takes the decisions an uninterrupted
 * one would: the loss scale, the count of good iterations toward its next growth (GradScaler's
 * growth tracker), and the iteration counts. The config (clipping, backoff, growth, the pipeline)
 * is not state: a new handle's config stands. Each rank saves and restores its own (the scale and
 * the counts are the same on every rank, except undone). Nothing here blocks or talks to a peer. */
#define ZB_POSTVAL_STATE_VERSION 1

typedef struct {
  uint32_t struct_size; /* sizeof(zb_postval_state_t) as the caller compiled it */
  uint32_t version;     /* ZB_POSTVAL_STATE_VERSION */
  double loss_scale;    /* the scale the next iteration's gradients carry */
  int64_t good_steps;   /* iterations without inf/NaN in a row since the scale last changed */
  int64_t steps;        /* iterations ended (zb_postval_end returned ZB_OK), skipped ones included */
  int64_t skipped;      /* of those: inf/NaN somewhere, no step */
  int64_t clipped;      /* of those: the factor included a clipping coefficient < 1 */
  int64_t undone;       /* of those: this rank undid its speculative step (d.undo) */
} zb_postval_state_t;

#define ZB_POSTVAL_STATE_INIT                                                                      \
  { sizeof(zb_postval_state_t), ZB_POSTVAL_STATE_VERSION, 1.0, 0, 0, 0, 0, 0 }

/* Copies the handle's state (as of the last zb_postval_end) into the caller's *out, whose
 * struct_size and version must be set (ZB_POSTVAL_STATE_INIT); nothing is kept. */
ZB_API zb_status_t zb_postval_get_state(const zb_postval_t *pv, zb_postval_state_t *out);
/* Replaces the handle's state with a copy of *state (nothing is kept). Fails with
 * ZB_ERR_INVALID_ARGUMENT, the handle unchanged, unless loss_scale is finite and > 0, good_steps
 * and steps >= 0 and skipped, clipped, undone in 0..steps; with ZB_ERR_BUSY between
 * zb_postval_begin and zb_postval_end (begin decided with the current scale). */
ZB_API zb_status_t zb_postval_set_state(zb_postval_t *pv, const zb_postval_state_t *state);

#ifdef __cplusplus
}
#endif

#endif /* ZBPP_H */
