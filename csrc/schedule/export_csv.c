/*
 * export_csv.c - reads and writes torch.distributed.pipelining's "compute_only" action CSV.
 *
 * The format: one row per rank (row r is rank r's ops in order), comma-separated cells, each cell
 * "<stage><type><microbatch>" such as "0F3". torch's types map onto ours as
 *   F -> F (forward),  I -> B (input-gradient backward),  W -> W,  B -> BW (torch's full backward).
 * torch writes an empty cell for an idle step; we skip those on import and never write them.
 *
 * Import also reads torch's lowered "compute_comms" form: transfer cells (SEND_F, RECV_F, SEND_B,
 * RECV_B) are skipped, because the runtime posts its own sends and receives from the channel rules,
 * and an overlapped pair "(0F1;3B0)OVERLAP_F_B" (DualPipeV's) becomes its ops one after the other.
 * REDUCE_GRAD (where torch >= 2.10 scales and reduces a stage's finished gradients) is skipped:
 * zbpp scales by its own scale_grads. UNSHARD and RESHARD manage FSDP-sharded stages, which zbpp
 * does not run: an error says so. Export writes the compute-only form, or the compute_comms form
 * (zb__export_csv_comms) with the transfers and REDUCE_GRAD cells torch's runtime needs. Import does not validate either: zb_schedule_validate is
 * the caller's next step and gives the better message for a schedule that parses but breaks a rule.
 * zbpp's copies (PipeOffload) are cells of two types of zbpp's own, "0OFFLOAD3" and "0RELOAD3",
 * which zbpp reads and writes and torch's runtime does not know.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* Bounds that keep every index in int and match the limits zb_schedule_create enforces. */
#define MAX_NUMBER 1000000   /* largest stage or microbatch number a cell may carry */
#define MAX_ROWS 65536       /* ranks */
#define MAX_STAGES 65536     /* S = p * v */
#define MAX_OPS 200000000LL  /* ops in the whole file, and 3 * S * m */

/* The CSV type of each of our op types, indexed by zb_op_type_t: torch's letter for the compute
 * ops, zbpp's own names for the copies. */
static const char *const csv_type[6] = {"F", "I", "W", "B", "OFFLOAD", "RELOAD"};

zb_status_t zb__export_csv(const zb_schedule_t *s, char **out, size_t *len) {
  zb__sbuf_t b = {0};
  for (int r = 0; r < s->p; r++) {
    for (int k = s->rank_off[r]; k < s->rank_off[r + 1]; k++) {
      const zb_op_t *op = &s->ops[k];
      /* A schedule from zb_schedule_create_from_ops is not validated; refuse what could not be read
       * back rather than write a file that import would reject. */
      if (op->type < ZB_OP_F || op->type > ZB_OP_RELOAD || op->stage < 0 || op->mb < 0) {
        free(b.buf);
        return ZB_FAIL(ZB_ERR_INVALID_SCHEDULE,
                       "rank %d, position %d: op (type %d, stage %d, mb %d) cannot be written as "
                       "CSV; types are F, B, W, BW, OFFLOAD, RELOAD and stage and microbatch must be >= 0 "
                       "(Vocabulary Parallelism's passes have no CSV cells: export JSON)",
                       r, k - s->rank_off[r], (int)op->type, (int)op->stage, (int)op->mb);
      }
      if (k > s->rank_off[r]) zb__sbuf_putc(&b, ',');
      zb__sbuf_printf(&b, "%d%s%d", (int)op->stage, csv_type[op->type], (int)op->mb);
    }
    zb__sbuf_putc(&b, '\n');
  }
  return zb__sbuf_finish(&b, out, len);
}

/* ---- export with transfers (torch's compute_comms form) -------------------------------------- */

/* A transfer an op makes: F sends its output to the next stage's rank, B/BW its input gradient to
 * the previous stage's rank (as torch's lowering, _add_send_recv, has it). Returns the peer rank or
 * -1, and the receiving stage in *to. */
static int sends_to(const zb_schedule_t *s, const zb_op_t *op, int *to) {
  int r = zb__stage_rank(s, op->stage);
  if (op->type == ZB_OP_F && op->stage + 1 < s->S && zb__stage_rank(s, op->stage + 1) != r) {
    *to = op->stage + 1;
    return zb__stage_rank(s, *to);
  }
  if ((op->type == ZB_OP_B || op->type == ZB_OP_BW) && op->stage > 0 && zb__stage_rank(s, op->stage - 1) != r) {
    *to = op->stage - 1;
    return zb__stage_rank(s, *to);
  }
  return -1;
}

typedef struct {
  int before; /* index (within the receiving rank) of the op the receive goes before */
  double sent; /* when the sender's op ends */
  int from, at; /* sender rank and the op's index in the flat array, for ties */
  int stage, mb, forward;
} recv_t;

static int recv_cmp(const void *pa, const void *pb) {
  const recv_t *a = pa, *b = pb;
  if (a->before != b->before) return a->before < b->before ? -1 : 1;
  if (a->sent != b->sent) return a->sent < b->sent ? -1 : 1;
  if (a->from != b->from) return a->from < b->from ? -1 : 1;
  return a->at < b->at ? -1 : a->at > b->at;
}

/* Each op as in the compute-only form, followed by its send; each receive goes before the first op
 * of the receiving rank that starts once the sender's op has ended (so before the op that needs
 * it), receives at one place in the order their sends ended. So every pair of ranks posts its
 * receives in the order the peer posts the sends, as torch's runtime (and NCCL) want. */
zb_status_t zb__export_csv_comms(const zb_schedule_t *s, char **out, size_t *len) {
  zb__sbuf_t b = {0};
  char *plain = NULL;
  size_t plain_len = 0;
  ZB_CHECK(zb__export_csv(s, &plain, &plain_len)); /* the same checks of every op */
  free(plain);
  recv_t *recvs = malloc((size_t)(s->n_ops ? s->n_ops : 1) * sizeof(recv_t));
  int *finished = malloc((size_t)s->S * sizeof(int)); /* per stage: W or fused backwards written */
  if (!recvs || !finished) {
    free(recvs);
    free(finished);
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for %d transfers", s->n_ops);
  }
  for (int r = 0; r < s->p; r++) {
    int n = 0, lo = s->rank_off[r], hi = s->rank_off[r + 1];
    for (int k = 0; k < s->n_ops; k++) {
      int to, peer = sends_to(s, &s->ops[k], &to);
      if (peer != r) continue;
      /* the first op of rank r starting at or after the send (binary search: starts ascend) */
      int a = lo, z = hi;
      while (a < z) {
        int mid = a + (z - a) / 2;
        if (s->start[mid] < s->end[k]) a = mid + 1;
        else z = mid;
      }
      int from = 0;
      while (s->rank_off[from + 1] <= k) from++;
      recvs[n++] = (recv_t){a - lo, s->end[k], from, k, to, s->ops[k].mb, s->ops[k].type == ZB_OP_F};
    }
    qsort(recvs, (size_t)n, sizeof *recvs, recv_cmp);
    /* torch >= 2.10's runtime scales (and, with data parallelism, reduces) a stage's gradients at
     * REDUCE_GRAD, which its lowering puts after the stage's m-th W or full backward. */
    memset(finished, 0, (size_t)s->S * sizeof *finished);
    int next = 0, first = 1;
    for (int k = lo; k <= hi; k++) {
      while (next < n && recvs[next].before == k - lo) {
        const recv_t *rv = &recvs[next++];
        zb__sbuf_printf(&b, "%s%d%s%d", first ? "" : ",", rv->stage, rv->forward ? "RECV_F" : "RECV_B", rv->mb);
        first = 0;
      }
      if (k == hi) break;
      const zb_op_t *op = &s->ops[k];
      zb__sbuf_printf(&b, "%s%d%s%d", first ? "" : ",", (int)op->stage, csv_type[op->type], (int)op->mb);
      first = 0;
      int to;
      if (sends_to(s, op, &to) >= 0)
        zb__sbuf_printf(&b, ",%d%s%d", (int)op->stage, op->type == ZB_OP_F ? "SEND_F" : "SEND_B", (int)op->mb);
      if ((op->type == ZB_OP_W || op->type == ZB_OP_BW) && ++finished[op->stage] == s->m)
        zb__sbuf_printf(&b, ",%dREDUCE_GRAD", (int)op->stage);
    }
    zb__sbuf_putc(&b, '\n');
  }
  free(recvs);
  free(finished);
  return zb__sbuf_finish(&b, out, len);
}

/* ---- import ----------------------------------------------------------------------------------- */

static int is_space(char c) { return c == ' ' || c == '\t' || c == '\r'; }
static int is_digit(char c) { return c >= '0' && c <= '9'; }
static int is_alpha(char c) { return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c == '_'; }

/* Copies up to 24 bytes of a cell into `out` for a message, replacing anything unprintable with '?'
 * (the input may be binary) and marking a cut with "...". */
static const char *cell_excerpt(const char *cell, size_t n, char out[32]) {
  size_t k = 0;
  for (; k < n && k < 24; k++) {
    unsigned char c = (unsigned char)cell[k];
    out[k] = (c >= 32 && c < 127) ? (char)c : '?';
  }
  if (k < n) out[k++] = '.', out[k++] = '.', out[k++] = '.';
  out[k] = '\0';
  return out;
}

/* Reads a run of digits as a bounded non-negative number. Returns the number of digits consumed
 * (0 if none), or -1 if the value exceeds MAX_NUMBER. */
static int read_number(const char *t, size_t n, size_t *pos, int *value) {
  long v = 0;
  int digits = 0;
  while (*pos < n && is_digit(t[*pos])) {
    v = v * 10 + (t[*pos] - '0');
    if (v > MAX_NUMBER) return -1;
    (*pos)++;
    digits++;
  }
  *value = (int)v;
  return digits;
}

/* Parses one trimmed, non-empty action "<stage><type><microbatch>". `row`/`col` are 1-based for the
 * message; rank = row - 1. *count gets 1 for a compute op, 0 for a transfer (skipped); transfers
 * are refused where `in_pair` (inside an OVERLAP_F_B). */
static zb_status_t parse_one(const char *cell, size_t n, int row, int col, int in_pair, zb_op_t *op,
                             int *count) {
  char ex[32];
  size_t pos = 0;
  int stage = 0, mb = 0;
  *count = 0;
  int d = read_number(cell, n, &pos, &stage);
  if (d < 0)
    return ZB_FAIL(ZB_ERR_PARSE,
                   "row %d (rank %d), column %d: cell '%s' has a stage number above %d; stage and "
                   "microbatch numbers must be between 0 and %d",
                   row, row - 1, col, cell_excerpt(cell, n, ex), MAX_NUMBER, MAX_NUMBER);
  size_t type_at = pos;
  while (pos < n && is_alpha(cell[pos])) pos++;
  size_t type_len = pos - type_at;
  if (d == 0 || type_len == 0)
    return ZB_FAIL(ZB_ERR_PARSE,
                   "row %d (rank %d), column %d: cell '%s' is not <stage><type><microbatch>, e.g. "
                   "0F3; types are F, I, B and W (and torch's SEND_F, RECV_F, SEND_B, RECV_B; zbpp's OFFLOAD, RELOAD)",
                   row, row - 1, col, cell_excerpt(cell, n, ex));
  char letter = cell[type_at];
  int is_compute = type_len == 1 && (letter == 'F' || letter == 'I' || letter == 'B' || letter == 'W');
  int is_comm = 0, copy = -1;
  if (!is_compute) {
    for (int t = ZB_OP_OFFLOAD; t <= ZB_OP_RELOAD; t++)
      if (strlen(csv_type[t]) == type_len && memcmp(csv_type[t], cell + type_at, type_len) == 0) copy = t;
  }
  if (!is_compute && copy < 0) {
    static const char *const comm[] = {"SEND_F", "RECV_F", "SEND_B", "RECV_B"};
    static const char *const sharding[] = {"UNSHARD", "RESHARD"};
    /* REDUCE_GRAD (torch >= 2.10: a stage's gradients are final; torch scales and reduces them
     * there): zbpp scales by its own scale_grads, so the cell says nothing to the runner. */
    static const char reduce[] = "REDUCE_GRAD";
    if (type_len == sizeof reduce - 1 && memcmp(reduce, cell + type_at, type_len) == 0 && pos == n) {
      if (in_pair)
        return ZB_FAIL(ZB_ERR_PARSE, "row %d (rank %d), column %d: cell '%s' is REDUCE_GRAD inside an OVERLAP_F_B pair",
                       row, row - 1, col, cell_excerpt(cell, n, ex));
      return ZB_OK;
    }
    for (size_t k = 0; k < sizeof comm / sizeof comm[0]; k++)
      if (strlen(comm[k]) == type_len && memcmp(comm[k], cell + type_at, type_len) == 0) is_comm = 1;
    if (is_comm && in_pair)
      return ZB_FAIL(ZB_ERR_PARSE,
                     "row %d (rank %d), column %d: cell '%s' is a transfer inside an OVERLAP_F_B pair; "
                     "a pair holds compute actions only, e.g. (0F1;3B0)OVERLAP_F_B",
                     row, row - 1, col, cell_excerpt(cell, n, ex));
    for (size_t k = 0; k < sizeof sharding / sizeof sharding[0]; k++)
      if (strlen(sharding[k]) == type_len && memcmp(sharding[k], cell + type_at, type_len) == 0)
        return ZB_FAIL(ZB_ERR_PARSE,
                       "row %d (rank %d), column %d: cell '%s' is %s, which manages FSDP-sharded "
                       "stages; zbpp does not run those: drop UNSHARD and RESHARD cells (the compute "
                       "actions F, I, B, W, the transfers and REDUCE_GRAD are read)",
                       row, row - 1, col, cell_excerpt(cell, n, ex), sharding[k]);
    if (!is_comm) {
      char ty[32];
      return ZB_FAIL(ZB_ERR_PARSE,
                     "row %d (rank %d), column %d: cell '%s' has type '%s'; torch's CSV types are F "
                     "(forward), I (input-gradient backward), B (full backward), W (weight-gradient "
                     "backward), the transfers SEND_F, RECV_F, SEND_B, RECV_B and (a;b)OVERLAP_F_B pairs; "
                     "zbpp's copies are OFFLOAD and RELOAD",
                     row, row - 1, col, cell_excerpt(cell, n, ex),
                     cell_excerpt(cell + type_at, type_len, ty));
    }
  }
  d = read_number(cell, n, &pos, &mb);
  if (d < 0)
    return ZB_FAIL(ZB_ERR_PARSE,
                   "row %d (rank %d), column %d: cell '%s' has a microbatch number above %d; stage "
                   "and microbatch numbers must be between 0 and %d",
                   row, row - 1, col, cell_excerpt(cell, n, ex), MAX_NUMBER, MAX_NUMBER);
  if (d == 0 || pos != n)
    return ZB_FAIL(ZB_ERR_PARSE,
                   "row %d (rank %d), column %d: cell '%s' is not <stage><type><microbatch>, e.g. "
                   "0F3; types are F, I, B and W (and torch's SEND_F, RECV_F, SEND_B, RECV_B; zbpp's OFFLOAD, RELOAD)",
                   row, row - 1, col, cell_excerpt(cell, n, ex));
  if (is_comm) return ZB_OK; /* the runner makes its own transfers */
  if (copy >= 0 && in_pair)
    return ZB_FAIL(ZB_ERR_PARSE,
                   "row %d (rank %d), column %d: cell '%s' is a copy inside an OVERLAP_F_B pair; a pair "
                   "holds compute actions only",
                   row, row - 1, col, cell_excerpt(cell, n, ex));
  op->type = copy >= 0 ? copy
             : letter == 'F' ? ZB_OP_F : letter == 'I' ? ZB_OP_B : letter == 'W' ? ZB_OP_W : ZB_OP_BW;
  op->stage = stage;
  op->mb = mb;
  *count = 1;
  return ZB_OK;
}

#define MAX_PAIR 4 /* sub-actions of one OVERLAP_F_B cell (DualPipeV writes 2) */

/* Parses one trimmed, non-empty cell into ops[0..*count): one action, or "(a;b)OVERLAP_F_B". */
static zb_status_t parse_cell(const char *cell, size_t n, int row, int col, zb_op_t ops[MAX_PAIR],
                              int *count) {
  char ex[32];
  *count = 0;
  if (cell[0] != '(') return parse_one(cell, n, row, col, 0, &ops[0], count);
  static const char pair[] = "OVERLAP_F_B";
  size_t close = 0;
  while (close < n && cell[close] != ')') close++;
  if (close == n || n - close - 1 != sizeof pair - 1 || memcmp(cell + close + 1, pair, sizeof pair - 1) != 0)
    return ZB_FAIL(ZB_ERR_PARSE,
                   "row %d (rank %d), column %d: cell '%s' starts with '(' but is not a pair like "
                   "(0F1;3B0)OVERLAP_F_B",
                   row, row - 1, col, cell_excerpt(cell, n, ex));
  for (size_t a = 1; a < close;) {
    size_t b = a;
    while (b < close && cell[b] != ';') b++;
    size_t x = a, y = b;
    while (x < y && is_space(cell[x])) x++;
    while (y > x && is_space(cell[y - 1])) y--;
    if (y > x) {
      if (*count == MAX_PAIR)
        return ZB_FAIL(ZB_ERR_PARSE, "row %d (rank %d), column %d: cell '%s' has more than %d actions in a pair",
                       row, row - 1, col, cell_excerpt(cell, n, ex), MAX_PAIR);
      int got = 0;
      ZB_CHECK(parse_one(cell + x, y - x, row, col, 1, &ops[*count], &got));
      *count += got;
    }
    a = b + 1;
  }
  if (*count == 0)
    return ZB_FAIL(ZB_ERR_PARSE, "row %d (rank %d), column %d: cell '%s' is an empty OVERLAP_F_B pair", row,
                   row - 1, col, cell_excerpt(cell, n, ex));
  return ZB_OK;
}

/* Is [a, b) only spaces, tabs and carriage returns? */
static int blank(const char *t, size_t a, size_t b) {
  for (size_t k = a; k < b; k++)
    if (!is_space(t[k])) return 0;
  return 1;
}

/* Placement from the ops: V when v == 2 and stage p appears on rank p-1 (the bottom of the V);
 * under loop placement stage p would sit on rank 0. */
static zb_placement_t infer_placement(const zb__oplists_t *l, int p, int v) {
  if (v != 2) return ZB_PLACEMENT_LOOP;
  for (int k = 0; k < l->count[p - 1]; k++)
    if (l->list[p - 1][k].stage == p) return ZB_PLACEMENT_V;
  return ZB_PLACEMENT_LOOP;
}

/* The stage -> rank map the ops imply when every stage 0..S-1 runs on exactly one rank and every
 * rank holds a stage; NULL otherwise (then the loop or V placement is assumed and validation names
 * what is wrong). The caller frees it. */
static int32_t *consistent_map(const zb__oplists_t *l, int p, int S) {
  int32_t *map = malloc((size_t)S * sizeof(int32_t));
  char *holds = calloc((size_t)p, 1);
  int ok = map && holds;
  for (int st = 0; ok && st < S; st++) map[st] = -1;
  for (int r = 0; ok && r < p; r++)
    for (int k = 0; ok && k < l->count[r]; k++) {
      int st = l->list[r][k].stage;
      if (map[st] >= 0 && map[st] != r) ok = 0;
      map[st] = r;
      holds[r] = 1;
    }
  for (int st = 0; ok && st < S; st++) ok = map[st] >= 0;
  for (int r = 0; ok && r < p; r++) ok = holds[r];
  free(holds);
  if (!ok) {
    free(map);
    return NULL;
  }
  return map;
}

/* Is a map (S a multiple of p) neither the loop nor the V? */
static int custom_map(const int32_t *map, int p, int S) {
  int loop = 1, vee = S == 2 * p;
  for (int st = 0; st < S; st++) {
    loop = loop && map[st] == st % p;
    vee = vee && map[st] == (st < p ? st : 2 * p - 1 - st);
  }
  return !loop && !vee;
}

zb_status_t zb__import_csv(zb_schedule_t **out, const char *text, size_t len,
                           const zb_schedule_spec_t *spec) {
  *out = NULL;
  /* Pass 1: the number of rows. Trailing blank lines (and a final newline) are not ranks; a blank
   * line between rows is a rank with no ops, which is what export writes for one. */
  long long rows = 0, lines = 0;
  for (size_t a = 0; a < len;) {
    size_t b = a;
    while (b < len && text[b] != '\n') b++;
    lines++;
    if (!blank(text, a, b)) rows = lines;
    if (rows > MAX_ROWS)
      return ZB_FAIL(ZB_ERR_PARSE, "row %lld: more than %d rows; the CSV has one row per rank and "
                                   "at most %d ranks are supported",
                     rows, MAX_ROWS, MAX_ROWS);
    a = b + 1;
  }
  if (rows == 0)
    return ZB_FAIL(ZB_ERR_PARSE,
                   "empty schedule: the CSV has no rows; it needs one row of cells like 0F3 per "
                   "rank");
  int p = (int)rows;

  /* Pass 2: the cells. */
  zb__oplists_t l;
  ZB_CHECK(zb__oplists_init(&l, p));
  zb_status_t st = ZB_OK;
  zb_schedule_t *s = NULL;
  int max_stage = -1, max_mb = -1;
  long long total = 0;
  size_t a = 0;
  for (int r = 0; r < p; r++) {
    size_t b = a;
    while (b < len && text[b] != '\n') b++;
    int col = 0;
    for (size_t c = a; c <= b;) {
      size_t e = c;
      while (e < b && text[e] != ',') e++;
      col++;
      size_t x = c, y = e;
      while (x < y && is_space(text[x])) x++;
      while (y > x && is_space(text[y - 1])) y--;
      if (y > x) { /* an empty cell is an idle step in torch's CSV */
        zb_op_t ops[MAX_PAIR];
        int got = 0;
        ZB_CHECK_GOTO(parse_cell(text + x, y - x, r + 1, col, ops, &got), st, fail);
        for (int k = 0; k < got; k++) {
          if (++total > MAX_OPS) {
            st = ZB_FAIL(ZB_ERR_PARSE, "row %d (rank %d): more than %lld ops in the CSV", r + 1, r,
                         MAX_OPS);
            goto fail;
          }
          ZB_CHECK_GOTO(zb__oplists_push(&l, r, ops[k].type, ops[k].stage, ops[k].mb), st, fail);
          if (ops[k].stage > max_stage) max_stage = ops[k].stage;
          if (ops[k].mb > max_mb) max_mb = ops[k].mb;
        }
      }
      c = e + 1;
    }
    a = b + 1;
  }
  if (total == 0) {
    st = ZB_FAIL(ZB_ERR_PARSE,
                 "empty schedule: %d rows but no ops; cells look like 0F3 (stage, type F/I/B/W, "
                 "microbatch)",
                 p);
    goto fail;
  }

  int S = max_stage + 1, m = max_mb + 1;
  if (S > MAX_STAGES || 3LL * S * m > MAX_OPS) {
    st = ZB_FAIL(ZB_ERR_PARSE,
                 "the CSV uses %d stages and %d microbatches over %d rows; at most %d stages and "
                 "3 * stages * microbatches <= %lld are supported",
                 S, m, p, MAX_STAGES, MAX_OPS);
    goto fail;
  }
  int32_t *map = consistent_map(&l, p, S);
  if (map && (S % p != 0 || custom_map(map, p, S))) {
    /* Every stage on one rank, every rank with a stage, but neither a loop nor the V (torch's
     * custom stage ids, ranks holding different numbers of stages): an explicit map. */
    zb_schedule_spec_t copy = *spec;
    copy.kind = ZB_KIND_CUSTOM;
    copy.ranks = p;
    copy.microbatches = m;
    if ((spec->stage_time_f || spec->stage_time_b || spec->stage_time_w || spec->stage_time_bw ||
        spec->stage_time_offload || spec->stage_time_reload) &&
        (long long)spec->ranks * (spec->chunks > 0 ? spec->chunks : 1) != S) {
      st = ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "the spec gives per-stage times for ranks * chunks = %lld stages, but the CSV has %d "
                   "stages; set ranks * chunks to %d or leave the stage_time arrays NULL",
                   (long long)spec->ranks * (spec->chunks > 0 ? spec->chunks : 1), S, S);
      free(map);
      goto fail;
    }
    st = zb__schedule_alloc_mapped(&s, &copy, p, S, m, map);
    free(map);
    if (st != ZB_OK) goto fail;
    ZB_CHECK_GOTO(zb__schedule_take_ops(s, &l), st, fail);
    zb__oplists_free(&l);
    *out = s;
    return ZB_OK;
  }
  free(map);
  if (S % p != 0) {
    st = ZB_FAIL(ZB_ERR_PARSE,
                 "the CSV uses %d stages (0..%d) over %d ranks (one row per rank); the number of "
                 "stages must be a multiple of the number of rows (v = stages / ranks chunks each)",
                 S, max_stage, p);
    goto fail;
  }
  int v = S / p;
  /* Per-stage times in the spec must describe exactly these stages, or alloc would read past the
   * caller's arrays. */
  if (spec->stage_time_f || spec->stage_time_b || spec->stage_time_w || spec->stage_time_bw ||
        spec->stage_time_offload || spec->stage_time_reload) {
    long long given = (long long)spec->ranks * (spec->chunks > 0 ? spec->chunks : 1);
    if (given != S) {
      st = ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "the spec gives per-stage times for ranks * chunks = %lld stages, but the CSV "
                   "has %d stages (%d rows, v = %d); set ranks and chunks to match or leave the "
                   "stage_time arrays NULL",
                   given, S, p, v);
      goto fail;
    }
  }

  zb_schedule_spec_t copy = *spec;
  copy.kind = ZB_KIND_CUSTOM;
  copy.ranks = p;
  copy.chunks = v;
  copy.microbatches = m;
  ZB_CHECK_GOTO(zb__schedule_alloc(&s, &copy, p, v, m, infer_placement(&l, p, v)), st, fail);
  ZB_CHECK_GOTO(zb__schedule_take_ops(s, &l), st, fail);
  zb__oplists_free(&l);
  *out = s;
  return ZB_OK;

fail:
  zb__oplists_free(&l);
  zb__schedule_free(s);
  return st;
}
