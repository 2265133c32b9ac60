/*
 * pattern_v.c - V-Half and V-Min from their building blocks ("Pipeline Parallelism with
 * Controllable Memory", Qi et al., 2024, sections 3-4): a candidate beside the searched rule sets
 * for the v-half and v-min kinds.
 *
 * The paper builds a V schedule by repeating one microbatch's block every 6 time slots (F and f,
 * the two chunks' forwards, B and b, their input backwards, then the W's): the offsets of the four
 * F/B ops inside the block fix each op's lifespan and so the peak memory, about 1/2 (V-Half) or
 * 1/3 (V-Min) of 1F1B's. Repeating the block leaves a valid pipeline with holes at both ends, so:
 *   1. W's go into the free slots, oldest B first;
 *   2. "squeeze": in slot order, every op of the warm-up and cool-down moves to the earliest free
 *      slot its dependencies allow, as long as the rank's peak memory (counted in slots: a forward
 *      holds its activations until its W) does not grow; then again without the W's, which are
 *      re-placed into the holes that are left;
 *   3. the slot order becomes each rank's op order; the simulator then times it with the real
 *      costs and T_comm.
 * Slots are unit times, so this shape ignores the costs; the costs decide afterwards whether it or
 * a searched schedule under the same peak memory is shorter (gen_zbv.c).
 *
 * Types, per rank r: 0 F of stage r, 1 F of stage 2p-1-r, 2 B of stage 2p-1-r, 3 B of stage r,
 * 4 W (of the k-th B in slot order) while squeezing; at the end W's of stage 2p-1-r (4) and of stage
 * r (5) separately.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

enum { NT = 6 };

typedef struct {
  int p, m, nt;  /* nt: types in use (4 without W, 5 with pooled W, 6 with W per chunk) */
  int *slot;     /* [rank][type][mb] */
} pat_t;

static int *at(pat_t *t, int r, int type) { return t->slot + ((size_t)r * NT + type) * t->m; }

/* Ops of a type on a rank: m, except the pooled W's (type 4 while nt is 5), which are 2m and use
 * type 5's room as well. */
static int len(const pat_t *t, int type) { return type == 4 && t->nt == 5 ? 2 * t->m : t->m; }

/* Ops of every type in use on a rank. */
static int per_rank(const pat_t *t) { return t->nt == 4 ? 4 * t->m : 6 * t->m; }

/* The op of rank r at the lowest slot among the types' next ones (ties: the lower type). */
static int next_of(pat_t *t, int r, const int *ptr, int *type) {
  int best = -1;
  for (int k = 0; k < t->nt; k++)
    if (ptr[k] < len(t, k) && (best < 0 || at(t, r, k)[ptr[k]] < at(t, r, best)[ptr[best]])) best = k;
  *type = best;
  return best < 0 ? -1 : at(t, r, best)[ptr[best]];
}

static int last_slot(pat_t *t, int r) {
  int last = 0;
  for (int k = 0; k < t->nt; k++)
    if (at(t, r, k)[len(t, k) - 1] > last) last = at(t, r, k)[len(t, k) - 1];
  return last;
}

/* Puts rank r's W's into its free slots, the oldest pending B's first; per chunk (types 4 and 5,
 * the returning chunk's first) or pooled (type 4). */
static void place_w(pat_t *t, int r, int split) {
  t->nt = 4; /* the F's and B's only: W's of this rank are about to be (re)placed */
  int ptr[NT] = {0}, pend[2] = {0, 0}, done[2] = {0, 0}, bound = last_slot(t, r);
  int i = 0;
  for (; i <= bound; i++) {
    int type, s = next_of(t, r, ptr, &type);
    if (s == i) {
      ptr[type]++;
      if (type == 2 || type == 3) pend[split ? type - 2 : 0]++;
      continue;
    }
    for (int w = 0; w < 2; w++)
      if (pend[w]) {
        at(t, r, 4 + w)[done[w]++] = i;
        pend[w]--;
        break;
      }
  }
  for (int w = 0; w < 2; w++)
    while (pend[w]-- > 0) at(t, r, 4 + w)[done[w]++] = i++;
  t->nt = split ? 6 : 5;
}

/* Rank r's peak memory in slot units: a forward adds 1, a W frees 1; without W's placed, each free
 * slot after a B stands for its W. */
static int peak_of(pat_t *t, int r) {
  int ptr[NT] = {0}, cur = 0, peak = 0, pend = 0, has_w = t->nt > 4;
  int bound = last_slot(t, r);
  for (int i = 0; i <= bound; i++) {
    int type, s = next_of(t, r, ptr, &type);
    if (s == i) {
      ptr[type]++;
      if (type <= 1) cur++;
      if (type >= 4) cur--;
      if (type == 2 || type == 3) pend++;
    } else if (!has_w && pend) {
      cur--;
      pend--;
    }
    if (cur > peak) peak = cur;
  }
  return peak;
}

/* The earliest slot an op may take: after its dependencies' slots. */
static int earliest(pat_t *t, int r, int type, int mb) {
  int d = -1, p = t->p;
#define DEP(x) \
  do {         \
    int v_ = (x); \
    if (v_ > d) d = v_; \
  } while (0)
  if ((type == 0 || type == 2) && r > 0) DEP(at(t, r - 1, type)[mb]);
  if ((type == 1 || type == 3) && r + 1 < p) DEP(at(t, r + 1, type)[mb]);
  if (type > 0 && type < 4) DEP(at(t, r, type - 1)[mb]);
  if (type == 4) { /* the mb-th W follows the mb-th B of either chunk */
    int i = 0, j = 0, *b2 = at(t, r, 2), *b3 = at(t, r, 3);
    for (int k = 0; k <= mb; k++) {
      int take2 = j >= t->m || (i < t->m && b2[i] < b3[j]);
      if (k == mb) DEP(take2 ? b2[i] : b3[j]);
      if (take2) i++;
      else j++;
    }
  }
  if (mb > 0) DEP(at(t, r, type)[mb - 1]);
#undef DEP
  return d + 1;
}

/* The next op in slot order over all ranks (ties: the lower rank, then the lower type), advancing
 * the per-rank, per-type positions in ptr; returns its microbatch. */
static int next_global(pat_t *t, int *ptr, int *rank, int *type) {
  int br = -1, bt = -1, bs = 0;
  for (int r = 0; r < t->p; r++)
    for (int k = 0; k < t->nt; k++) {
      int i = ptr[r * NT + k];
      if (i >= len(t, k)) continue;
      int s = at(t, r, k)[i];
      if (br < 0 || s < bs) br = r, bt = k, bs = s;
    }
  *rank = br, *type = bt;
  return ptr[br * NT + bt]++;
}

/* One squeeze pass over all ranks in slot order (ties: lower rank, then type, then microbatch). */
static void squeeze(pat_t *t, int with_w) {
  int p = t->p, m = t->m;
  int peak = 0;
  for (int r = 0; r < p; r++) {
    int x = peak_of(t, r);
    if (x > peak) peak = x;
  }
  int *ptr = calloc((size_t)p * NT, sizeof(int));
  /* Ops only move to earlier slots, so the last slot in use now bounds every rank's slots. */
  int cap = 1;
  for (int r = 0; r < p; r++)
    if (last_slot(t, r) + 1 > cap) cap = last_slot(t, r) + 1;
  unsigned char *occ = calloc((size_t)p * cap, 1);
  if (!ptr || !occ) {
    free(ptr), free(occ);
    return; /* the caller's validation of the result catches an unsqueezed shape as well */
  }
  int phase = 0;
  long long total = (long long)p * per_rank(t);
  for (long long e = 0; e < total; e++) {
    int br, bt, mb = next_global(t, ptr, &br, &bt);
    if (bt == 3 && br == 0 && phase == 0) phase = 1;
    int fixed = phase == 1 || (phase == 0 && !with_w);
    if (phase == 1 && bt == 0 && mb == m - 1) phase = 2;
    int *slot = &at(t, br, bt)[mb];
    if (!fixed) {
      int to = *slot;
      for (int s = earliest(t, br, bt, mb); s < *slot; s++) {
        if (occ[(size_t)br * cap + s]) continue;
        int was = *slot;
        *slot = s;
        int ok = peak_of(t, br) <= peak;
        *slot = was;
        if (ok) {
          to = s;
          break;
        }
      }
      *slot = to;
    }
    occ[(size_t)br * cap + *slot] = 1;
  }
  free(ptr), free(occ);
}

/* Re-times every op as the earliest unit-time slot its dependencies and its rank's order allow. */
static void compact(pat_t *t) {
  int p = t->p, m = t->m;
  int *ptr = calloc((size_t)p * NT, sizeof(int));
  int *free_at = calloc((size_t)p, sizeof(int));
  int *fresh = malloc((size_t)p * NT * m * sizeof(int));
  if (!ptr || !free_at || !fresh) {
    free(ptr), free(free_at), free(fresh);
    return;
  }
  memcpy(fresh, t->slot, (size_t)p * NT * m * sizeof(int));
  long long total = (long long)p * per_rank(t);
  for (long long e = 0; e < total; e++) {
    int br, bt, mb = next_global(t, ptr, &br, &bt);
    /* Dependencies on ops already re-timed (they come earlier in slot order). */
    int d = free_at[br];
    int *F = fresh;
#define NEW(r_, k_, i_) F[((size_t)(r_) * NT + (k_)) * m + (i_)]
    if ((bt == 0 || bt == 2) && br > 0 && NEW(br - 1, bt, mb) + 1 > d) d = NEW(br - 1, bt, mb) + 1;
    if ((bt == 1 || bt == 3) && br + 1 < p && NEW(br + 1, bt, mb) + 1 > d) d = NEW(br + 1, bt, mb) + 1;
    if (bt > 0 && bt < 4 && NEW(br, bt - 1, mb) + 1 > d) d = NEW(br, bt - 1, mb) + 1;
    if (mb > 0 && NEW(br, bt, mb - 1) + 1 > d) d = NEW(br, bt, mb - 1) + 1;
    NEW(br, bt, mb) = d;
#undef NEW
    free_at[br] = d + 1;
  }
  memcpy(t->slot, fresh, (size_t)p * NT * m * sizeof(int));
  free(ptr), free(free_at), free(fresh);
}

zb_status_t zb__pattern_v(zb_schedule_t *s, int third) {
  int p = s->p, m = s->m;
  if (s->placement != ZB_PLACEMENT_V || s->v != 2)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "the V building blocks need the V placement");
  pat_t t = {p, m, 4, NULL};
  t.slot = malloc((size_t)p * NT * m * sizeof(int));
  if (!t.slot) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for %d x %d slots", p, m);
  /* One microbatch's block: the slot of each of its four F/B ops on rank r; microbatch k's are
   * 6k later. The gaps between the offsets are the lifespans that set the memory. */
  for (int r = 0; r < p; r++) {
    int off[4];
    if (third) {
      int gap = p % 3 == 0 ? 2 : 0;
      off[0] = r, off[1] = 2 * p - r - 1, off[2] = 2 * p + gap + r, off[3] = 4 * p + gap - r - 1;
    } else {
      int gap = p % 2 == 0 ? 3 : 0;
      off[0] = 2 * r, off[1] = 3 * p - r - 2, off[2] = 3 * p + gap + 2 * r - 1;
      off[3] = 6 * p + gap - r - 2;
    }
    for (int k = 0; k < 4; k++)
      for (int i = 0; i < m; i++) at(&t, r, k)[i] = off[k] + 6 * i;
  }
  for (int r = 0; r < p; r++) place_w(&t, r, 0);
  squeeze(&t, 1);
  compact(&t);
  t.nt = 4; /* drop the W's, squeeze the cool-down again, re-place them */
  squeeze(&t, 0);
  for (int r = 0; r < p; r++) place_w(&t, r, 0);
  compact(&t);
  t.nt = 4;
  for (int r = 0; r < p; r++) place_w(&t, r, 1);

  /* Slot order -> op lists. */
  zb__oplists_t l;
  zb_status_t st = zb__oplists_init(&l, p);
  for (int r = 0; r < p && st == ZB_OK; r++) {
    int ptr[NT] = {0};
    for (int e = 0; e < 6 * m && st == ZB_OK; e++) {
      int type;
      next_of(&t, r, ptr, &type);
      int mb = ptr[type]++;
      int down = r, up = 2 * p - 1 - r;
      static const int op_type[NT] = {ZB_OP_F, ZB_OP_F, ZB_OP_B, ZB_OP_B, ZB_OP_W, ZB_OP_W};
      int stage = (type == 0 || type == 3 || type == 5) ? down : up;
      st = zb__oplists_push(&l, r, op_type[type], stage, mb);
    }
  }
  if (st == ZB_OK) st = zb__schedule_take_ops(s, &l);
  zb__oplists_free(&l);
  free(t.slot);
  return st;
}
