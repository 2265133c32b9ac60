/*
 * gen_gis.c - group-interleaved 1F1B ("GIS", the PipeOffload paper's base schedule; the reference
 * fork's zerobubble/scheduler/group_interleaved_1f1b.py, GroupBuildingBlockScheduler), built as
 * the reference builds it, so a plan here is the reference's op for op (benchmarks/
 * compare_offload_reference.py checks that against its code):
 *
 *   1. A building block of 3 G v slots per rank: F of chunk c, group member g on rank d at slot
 *      3 k G c + 3 g + d (k = ceil(min_group / G), plus 3 G more for every v / gcd(v, k) chunks),
 *      the backwards of the last chunk first starting after rank d's first F of the last chunk plus
 *      3 (p - 1 - d), each B followed by its W.
 *   2. Unrolled to its absolute slots and repeated every 3 G v slots for ceil(m / G) groups of G
 *      microbatches; microbatches beyond m dropped.
 *   3. Shifted so every chunk's F comes after the previous chunk's on the last rank, then, with
 *      G > 1, squeezed: each slot runs the next op of a rank as soon as the op before it in the
 *      model (F: the previous stage's, B: the next stage's) has run.
 *
 * Stage c p + d is chunk c of rank d (loop placement). The group size is the reference's
 * create_schedule default: ceil(p / 2), raised until max_d(F + B + W) times it covers the larger
 * of the F and B sums over the ranks' first chunks. B and W are split; W right after its B.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

typedef struct {
  int type; /* ZB_OP_F, ZB_OP_B, ZB_OP_W; -1: an empty slot */
  int chunk, micro, offset;
} pass_t;

static const pass_t EMPTY = {-1, -1, -1, -1};

static int gcd(int a, int b) {
  while (b) {
    int t = a % b;
    a = b, b = t;
  }
  return a;
}

/* The group size as the reference's create_schedule picks it from per-rank (first chunk) costs. */
static int group_size(const zb_schedule_t *s) {
  const int p = s->p;
  int g = (p + 1) / 2;
  double max_fbw = 0, sum_f = 0, sum_b = 0;
  for (int d = 0; d < p; d++) {
    double fbw = s->tf[d] + s->tb[d] + s->tw[d];
    if (fbw > max_fbw) max_fbw = fbw;
    sum_f += s->tf[d], sum_b += s->tb[d];
  }
  while (g < p && max_fbw * g < (sum_f > sum_b ? sum_f : sum_b)) g++;
  return g;
}

/* A grid of ranks x len slots. */
typedef struct {
  int p, len;
  pass_t *cell;
} grid_t;

static zb_status_t grid_new(grid_t *g, int p, long long len) {
  if (len < 1) len = 1;
  if ((long long)p * len > 400000000LL)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "group-interleaved-1f1b: %d ranks x %lld slots is too large", p, len);
  g->p = p, g->len = (int)len;
  g->cell = malloc((size_t)p * (size_t)len * sizeof(pass_t));
  if (!g->cell) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for %d x %lld slots", p, len);
  for (long long i = 0; i < (long long)p * len; i++) g->cell[i] = EMPTY;
  return ZB_OK;
}

static pass_t *at(const grid_t *g, int d, int i) { return &g->cell[(size_t)d * (size_t)g->len + (size_t)i]; }

/* Steps 1 and 2: the block's passes at their absolute slots, repeated for the groups (the
 * reference's get_optimal_building_block, unroll_building_block, repeat_building_block and
 * remove_redundant_micro). */
static zb_status_t repeated(const zb_schedule_t *s, int G, grid_t *out) {
  const int p = s->p, V = s->v, m = s->m, min_group = (p + 1) / 2;
  const int min_k = (min_group + G - 1) / G, gcd_kv = gcd(V, min_k), bb_len = 3 * G * V;
  const int step = V / gcd_kv > 0 ? V / gcd_kv : 1;
  pass_t *block = malloc((size_t)p * (size_t)bb_len * sizeof(pass_t));
  int *last_f = malloc((size_t)p * sizeof(int));
  if (!block || !last_f) {
    free(block), free(last_f);
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for the building block");
  }
  for (int i = 0; i < p * bb_len; i++) block[i] = EMPTY;
  zb_status_t st = ZB_OK;
  int max_offset = 0;
  for (int c = 0; c < V && st == ZB_OK; c++)
    for (int g = 0; g < G && st == ZB_OK; g++)
      for (int d = 0; d < p; d++) {
        int f = 3 * min_k * G * c + 3 * g + d + 3 * G * (c / step);
        pass_t *cell = &block[d * bb_len + f % bb_len];
        if (cell->type >= 0) {
          st = ZB_FAIL(ZB_ERR_INTERNAL, "group-interleaved-1f1b: two forwards in slot %d of rank %d", f % bb_len, d);
          break;
        }
        *cell = (pass_t){ZB_OP_F, c, g, f};
        if (f > max_offset) max_offset = f;
        if (c == V - 1 && g == 0) last_f[d] = f;
      }
  for (int c = 0; c < V && st == ZB_OK; c++)
    for (int g = 0; g < G && st == ZB_OK; g++)
      for (int d = 0; d < p; d++) {
        int first_b = last_f[d] + (p - 1 - d) + 1 + (p - 1 - d) * 2;
        int b = first_b + 3 * min_k * G * c + 3 * g + 3 * G * (c / step);
        pass_t *cb = &block[d * bb_len + b % bb_len], *cw = &block[d * bb_len + (b + 1) % bb_len];
        if (cb->type >= 0 || cw->type >= 0) {
          st = ZB_FAIL(ZB_ERR_INTERNAL, "group-interleaved-1f1b: a backward collides in slot %d of rank %d",
                       b % bb_len, d);
          break;
        }
        *cb = (pass_t){ZB_OP_B, V - 1 - c, g, b};
        *cw = (pass_t){ZB_OP_W, V - 1 - c, g, b + 1};
        if (b + 1 > max_offset) max_offset = b + 1;
      }
  /* Unrolled: each pass at its own offset (one block's worth); repeated every bb_len slots. */
  const int groups = (m + G - 1) / G;
  if (st == ZB_OK) st = grid_new(out, p, (long long)max_offset + 1 + (long long)bb_len * (groups - 1));
  for (int d = 0; d < p && st == ZB_OK; d++)
    for (int i = 0; i < bb_len; i++) {
      pass_t node = block[d * bb_len + i];
      for (int q = 0; q < groups; q++) {
        pass_t rep = node;
        rep.micro = node.micro + q * G;
        if (rep.micro < m) *at(out, d, node.offset + bb_len * q) = rep;
      }
    }
  free(block), free(last_f);
  return st;
}

/* Step 3a: the reference's shift_schedule2meet_dependency. */
static zb_status_t shifted(const zb_schedule_t *s, const grid_t *in, grid_t *out) {
  const int p = s->p, V = s->v, m = s->m;
  int *f_at = malloc((size_t)V * (size_t)m * sizeof(int)); /* last rank: slot of F(micro, chunk) */
  if (!f_at) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory shifting the schedule");
  for (int i = 0; i < V * m; i++) f_at[i] = -1;
  for (int j = 0; j < in->len; j++) {
    const pass_t *n = at(in, p - 1, j);
    if (n->type == ZB_OP_F) f_at[n->chunk * m + n->micro] = j;
  }
  int extra = p - 1;
  for (int j = 0; j < in->len; j++) {
    const pass_t *n = at(in, 0, j);
    if (n->type < 0 || n->chunk == 0) continue;
    int off = j - 1 - f_at[(n->chunk - 1) * m + n->micro];
    if (off < extra) extra = off;
  }
  if (extra < 0) {
    free(f_at);
    return ZB_FAIL(ZB_ERR_INTERNAL, "group-interleaved-1f1b: a chunk's forward comes before the previous chunk's");
  }
  zb_status_t st = grid_new(out, p, (long long)in->len + extra);
  for (int d = 0; d < p && st == ZB_OK; d++) {
    int pad = d < extra ? d : extra;
    for (int j = 0; j < in->len; j++) *at(out, d, pad + j) = *at(in, d, j);
  }
  free(f_at);
  return st;
}

/* Step 3b: the reference's squeeze_without_change_order; ops in *lists. */
static zb_status_t squeezed(const zb_schedule_t *s, const grid_t *in, int squeeze, zb__oplists_t *lists) {
  const int p = s->p, V = s->v, m = s->m, S = p * V;
  zb_status_t st = ZB_OK;
  if (!squeeze) {
    for (int d = 0; d < p && st == ZB_OK; d++)
      for (int j = 0; j < in->len && st == ZB_OK; j++) {
        const pass_t *n = at(in, d, j);
        if (n->type >= 0) st = zb__oplists_push(lists, d, n->type, n->chunk * p + d, n->micro);
      }
    return st;
  }
  /* done[(type * S + layer) * m + micro]: finalised in an earlier slot. */
  unsigned char *done = calloc((size_t)3 * (size_t)S * (size_t)m, 1);
  int *cur = calloc((size_t)p, sizeof(int));
  const pass_t **slot = calloc((size_t)p, sizeof(pass_t *));
  if (!done || !cur || !slot) {
    free(done), free(cur), free(slot);
    return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory squeezing the schedule");
  }
  for (int i = 0; i < in->len && st == ZB_OK; i++) {
    for (int d = 0; d < p; d++) {
      slot[d] = NULL;
      while (cur[d] < in->len && at(in, d, cur[d])->type < 0) cur[d]++;
      if (cur[d] >= in->len) continue;
      const pass_t *n = at(in, d, cur[d]);
      int layer = n->chunk * p + d;
      int prev = n->type == ZB_OP_F ? layer - 1 : n->type == ZB_OP_B ? layer + 1 : layer;
      if (prev < 0) prev = 0;
      if (prev > S - 1) prev = S - 1;
      int t = n->type == ZB_OP_F ? 0 : n->type == ZB_OP_B ? 1 : 2;
      if (prev == layer || done[((size_t)t * S + (size_t)prev) * (size_t)m + (size_t)n->micro]) {
        slot[d] = n;
        cur[d]++;
      }
    }
    for (int d = 0; d < p && st == ZB_OK; d++) {
      const pass_t *n = slot[d];
      if (!n) continue;
      int t = n->type == ZB_OP_F ? 0 : n->type == ZB_OP_B ? 1 : 2;
      done[((size_t)t * S + (size_t)(n->chunk * p + d)) * (size_t)m + (size_t)n->micro] = 1;
      st = zb__oplists_push(lists, d, n->type, n->chunk * p + d, n->micro);
    }
  }
  for (int d = 0; d < p && st == ZB_OK; d++) {
    while (cur[d] < in->len && at(in, d, cur[d])->type < 0) cur[d]++;
    if (cur[d] < in->len)
      st = ZB_FAIL(ZB_ERR_INTERNAL, "group-interleaved-1f1b: rank %d's ops did not all fit when squeezed", d);
  }
  free(done), free(cur), free(slot);
  return st;
}

zb_status_t zb__gen_gis(zb_schedule_t *s) {
  const int G = group_size(s);
  grid_t rep = {0, 0, NULL}, sh = {0, 0, NULL};
  zb__oplists_t lists;
  zb_status_t st = repeated(s, G, &rep);
  if (st == ZB_OK) st = shifted(s, &rep, &sh);
  free(rep.cell);
  if (st == ZB_OK) st = zb__oplists_init(&lists, s->p);
  if (st == ZB_OK) {
    st = squeezed(s, &sh, G > 1, &lists);
    if (st == ZB_OK) st = zb__schedule_take_ops(s, &lists);
    zb__oplists_free(&lists);
  }
  free(sh.cell);
  return st;
}
