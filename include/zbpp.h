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
 * Threading: schedule handles are not internally locked. Different handles may be used from
 * different threads at once; one handle must not be used from two threads at once. None of the
 * calls in this header block on anything but the CPU work they do.
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
 * stays valid until the next zbpp call on this thread; copy it if you need it longer. */
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
} zb_op_type_t;

typedef struct {
  int32_t type;  /* a zb_op_type_t */
  int32_t stage; /* 0 .. S-1 */
  int32_t mb;    /* microbatch, 0 .. m-1 */
} zb_op_t;

typedef enum {
  ZB_PLACEMENT_LOOP = 0,
  ZB_PLACEMENT_V = 1,
} zb_placement_t;

#define ZB_KIND_LIST(X)                                                                            \
  X(ZB_KIND_GPIPE, 0, "gpipe", "all forwards, then all fused backwards (peak memory m)")           \
  X(ZB_KIND_1F1B, 1, "1f1b", "one forward one backward, fused backward (PipeDream-flush, peak p)") \
  X(ZB_KIND_INTERLEAVED_1F1B, 2, "interleaved-1f1b",                                               \
    "Megatron's interleaved 1F1B, v >= 2 chunks in a loop, m a multiple of p")                     \
  X(ZB_KIND_ZB_H1, 3, "zb-h1", "handcrafted zero bubble, 1F1B's memory (p), about 1/3 the bubble") \
  X(ZB_KIND_ZB_H2, 4, "zb-h2", "handcrafted zero bubble, memory 2p-1, no bubble once m is large") \
  X(ZB_KIND_ZB_V, 5, "zb-v", "two chunks in a V, memory p, no bubble once m >= 2p")                \
  X(ZB_KIND_V_HALF, 6, "v-half", "V schedule at about half of 1F1B's activation memory")           \
  X(ZB_KIND_V_MIN, 7, "v-min", "V schedule at about a third of 1F1B's activation memory")          \
  X(ZB_KIND_ZB_AUTO, 8, "zb-auto",                                                                 \
    "automatic: the shortest schedule found for the costs under a memory limit (default p)")       \
  X(ZB_KIND_CUSTOM, 9, "custom", "imported from a file; no generator")

typedef enum {
#define ZB_X_ENUM(name, value, text, help) name = value,
  ZB_KIND_LIST(ZB_X_ENUM)
#undef ZB_X_ENUM
} zb_kind_t;

#define ZB_KIND_COUNT 10

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
 * need; struct_size/version let the library accept specs from older callers.
 *
 * Times: time_f/time_b/time_w/time_bw are the time of one microbatch through ALL of a rank's layers
 * (so each op of a v-chunk schedule takes 1/v of it). A value <= 0 for time_bw means time_b + time_w.
 * stage_time_f/b/w/bw, when not NULL, point at S values each (one per stage, absolute, not divided by
 * v) and override the scalar for that op type; they are copied during the call (the caller keeps
 * ownership). mem_limit is in units of one microbatch's activations through all of a rank's layers;
 * <= 0 means no limit (zb-auto then keeps 1F1B's memory, p).
 * ------------------------------------------------------------------------------------------- */
#define ZB_SCHEDULE_SPEC_VERSION 1

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
} zb_schedule_spec_t;

#define ZB_SCHEDULE_SPEC_INIT                                                                      \
  {                                                                                                \
    sizeof(zb_schedule_spec_t), ZB_SCHEDULE_SPEC_VERSION, ZB_KIND_1F1B, 1, 0, 1, 1.0, 1.0, 1.0,    \
        0.0, NULL, NULL, NULL, NULL, 0.0, 0.5, 0.0                                                 \
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
 * set. ZB_ERR_INVALID_SCHEDULE with a message naming the rank, the position and the rule broken. */
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

/* After zb_schedule_simulate: start/end of rank r's ops (aligned with zb_schedule_rank_ops). */
ZB_API zb_status_t zb_schedule_rank_times(const zb_schedule_t *schedule, int32_t rank,
                                          const double **start, const double **end);
/* After zb_schedule_simulate: rank r's span, busy time and peak memory. */
ZB_API zb_status_t zb_schedule_rank_stats(const zb_schedule_t *schedule, int32_t rank, double *span,
                                          double *busy, double *peak_memory);

typedef enum {
  ZB_FORMAT_TEXT = 0,   /* a rank-by-time grid for a terminal */
  ZB_FORMAT_CSV = 1,    /* torch.distributed.pipelining's compute_only action grammar */
  ZB_FORMAT_JSON = 2,   /* the zbpp JSON shape (README) */
  ZB_FORMAT_CHROME = 3, /* Chrome trace / Perfetto JSON */
  ZB_FORMAT_SVG = 4,    /* a timeline in the style of the paper's figures */
} zb_format_t;

/* Parses "text", "csv", "json", "chrome" or "svg". */
ZB_API zb_status_t zb_format_from_name(const char *name, zb_format_t *out);

/* Writes the schedule in a format into a NUL-terminated buffer the caller frees with zb_free.
 * Formats with times (text, json, chrome, svg) simulate first if that has not been done. */
ZB_API zb_status_t zb_schedule_export(zb_schedule_t *schedule, zb_format_t format, char **out_text,
                                      size_t *out_len);

/* Reads a schedule from text. Only ZB_FORMAT_CSV is accepted: one row per rank, cells like "0F3"
 * (stage, type, microbatch) where the type is F, I (our B), W, or B (our BW, torch's full backward);
 * empty cells (torch's idle steps) are skipped. p is the number of rows, S the largest stage + 1,
 * v = S / p, m the largest microbatch + 1, and the placement is inferred (V when stage p sits on rank
 * p-1). Costs, w-share and memory limit come from spec (its ranks/chunks/microbatches/kind are
 * ignored, except that per-stage time arrays need ranks * chunks to equal the file's stage count;
 * spec may be NULL for the defaults). The result is not validated: call zb_schedule_validate. */
ZB_API zb_status_t zb_schedule_import(zb_schedule_t **out, zb_format_t format, const char *text,
                                      size_t len, const zb_schedule_spec_t *spec);

#ifdef __cplusplus
}
#endif

#endif /* ZBPP_H */
