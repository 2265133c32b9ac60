/*
 * wstore.c - the deferred weight-gradient store (DESIGN.md section 4, the paper's B/W split).
 *
 * During B the split-backward layers push plain-data entries (pointers, shapes, dtype, the fp32
 * buffer to accumulate into) into the group of the backward op being run; the runner's W op (and
 * the W part of a fused BW) runs the group of its own stage and microbatch, in push order
 * (zb__wstore_pop_run_mb), so a stage's accumulations run in the schedule's order of its W and BW
 * ops; zb_wstore_pop_run, for callers without a schedule, runs a stage's oldest group. Every
 * generated schedule runs them in microbatch order (a mix of B + W and BW too: fuse.c keeps it),
 * which is what makes the pipelined gradients bit-for-bit equal to a sequential loop's.
 *
 * What it is not: a scheduler (the schedule decides when W runs) or an owner of tensors. It keeps
 * no closures; the caller learns through one release callback when an entry's tensors may go.
 * Groups and entry arrays are recycled, so pushing and popping allocate nothing once warm.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

typedef struct group {
  int32_t stage, mb;
  zb_wgrad_t *entries;
  int n, cap;
  struct group *next;
} group_t;

typedef struct {
  group_t *head, *tail;
  int32_t count;
} fifo_t;

struct zb_wstore {
  zb_backend_t *backend;
  zb_wgrad_release_cb release;
  void *release_user;
  fifo_t *fifo; /* one per stage, grown on demand */
  int32_t n_stages;
  group_t *open;
  group_t *spare; /* recycled groups */
};

zb_status_t zb_wstore_create(zb_wstore_t **out, zb_backend_t *backend, zb_wgrad_release_cb release_cb,
                             void *release_user) {
  ZB_ARG_NOT_NULL(out);
  *out = NULL;
  ZB_ARG_NOT_NULL(backend);
  zb_wstore_t *w = calloc(1, sizeof(*w));
  if (!w) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory creating a W store");
  w->backend = backend;
  w->release = release_cb;
  w->release_user = release_user;
  zb__backend_ref(backend);
  *out = w;
  return ZB_OK;
}

/* Hands one entry back. A failing callback fails the call that released it, with the callback's
 * status and message; *first keeps the first failure when several entries go at once, and every
 * entry is still handed back (the caller must learn about all its tensors). */
static void release_one(zb_wstore_t *w, const zb_wgrad_t *e, int32_t ran, zb_status_t *first) {
  if (!w->release) return;
  zb_status_t st = w->release(w->release_user, e->token, ran);
  if (st != ZB_OK && *first == ZB_OK) {
    char inner[512];
    snprintf(inner, sizeof inner, "%s", zb_last_error());
    *first = ZB_FAIL(st, "the W store's release callback returned %s for token %llu (%s)%s%s",
                     zb_status_string(st), (unsigned long long)e->token,
                     ran ? "after its GEMM ran" : "dropped unrun", inner[0] ? ": " : "", inner);
  }
}

static void drop_group(zb_wstore_t *w, group_t *g, zb_status_t *first) {
  for (int k = 0; k < g->n; k++) release_one(w, &g->entries[k], 0, first);
  g->n = 0;
  g->next = w->spare;
  w->spare = g;
}

zb_status_t zb_wstore_clear(zb_wstore_t *w) {
  ZB_ARG_NOT_NULL(w);
  zb_status_t first = ZB_OK;
  if (w->open) {
    drop_group(w, w->open, &first);
    w->open = NULL;
  }
  for (int32_t s = 0; s < w->n_stages; s++) {
    group_t *g = w->fifo[s].head;
    while (g) {
      group_t *next = g->next;
      drop_group(w, g, &first);
      g = next;
    }
    w->fifo[s] = (fifo_t){NULL, NULL, 0};
  }
  return first;
}

zb_status_t zb_wstore_destroy(zb_wstore_t *w) {
  if (!w) return ZB_OK;
  zb_status_t st = zb_wstore_clear(w); /* freed even so: every entry was handed back */
  while (w->spare) {
    group_t *g = w->spare;
    w->spare = g->next;
    free(g->entries);
    free(g);
  }
  zb__backend_unref(w->backend);
  free(w->fifo);
  free(w);
  return st;
}

zb_status_t zb_wstore_begin(zb_wstore_t *w, int32_t stage, int32_t mb) {
  ZB_ARG_NOT_NULL(w);
  if (stage < 0 || mb < 0)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "zb_wstore_begin: stage %d, microbatch %d; both must be >= 0",
                   (int)stage, (int)mb);
  if (w->open)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "zb_wstore_begin(stage %d, mb %d): the group of stage %d mb %d is still open; "
                   "call zb_wstore_end first",
                   (int)stage, (int)mb, (int)w->open->stage, (int)w->open->mb);
  if (stage >= w->n_stages) {
    int32_t n = stage + 1 > 2 * w->n_stages ? stage + 1 : 2 * w->n_stages;
    fifo_t *f = realloc(w->fifo, (size_t)n * sizeof(fifo_t));
    if (!f) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory growing the W store to %d stages", (int)n);
    for (int32_t s = w->n_stages; s < n; s++) f[s] = (fifo_t){NULL, NULL, 0};
    w->fifo = f;
    w->n_stages = n;
  }
  group_t *g = w->spare;
  if (g) {
    w->spare = g->next;
  } else {
    g = calloc(1, sizeof(*g));
    if (!g) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory for a W-store group");
  }
  g->stage = stage, g->mb = mb, g->n = 0, g->next = NULL;
  w->open = g;
  return ZB_OK;
}

zb_status_t zb_wstore_push(zb_wstore_t *w, const zb_wgrad_t *e) {
  ZB_ARG_NOT_NULL(w);
  ZB_CHECK(zb__wgrad_check(e));
  group_t *g = w->open;
  if (!g)
    return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT,
                   "zb_wstore_push outside a backward op: no group is open (the runner opens one "
                   "around each backward callback; without a runner call zb_wstore_begin first)");
  if (g->n == g->cap) {
    int cap = g->cap ? 2 * g->cap : 8;
    zb_wgrad_t *ne = realloc(g->entries, (size_t)cap * sizeof(zb_wgrad_t));
    if (!ne) return ZB_FAIL(ZB_ERR_OUT_OF_MEMORY, "out of memory growing a W-store group to %d entries", cap);
    g->entries = ne, g->cap = cap;
  }
  /* Copy only what the caller's struct has (an older, shorter zb_wgrad_t is accepted); the fields
   * it lacks are zero, which are their defaults. */
  zb_wgrad_t *slot = &g->entries[g->n++];
  memset(slot, 0, sizeof *slot);
  memcpy(slot, e, e->struct_size < sizeof *slot ? e->struct_size : sizeof *slot);
  slot->struct_size = sizeof *slot;
  return ZB_OK;
}

zb_status_t zb_wstore_end(zb_wstore_t *w) {
  ZB_ARG_NOT_NULL(w);
  group_t *g = w->open;
  if (!g) return ZB_FAIL(ZB_ERR_INVALID_ARGUMENT, "zb_wstore_end: no group is open");
  fifo_t *f = &w->fifo[g->stage];
  if (f->tail) f->tail->next = g;
  else f->head = g;
  f->tail = g;
  f->count++;
  w->open = NULL;
  return ZB_OK;
}

/* Runs group g (already unlinked) and recycles it. */
static zb_status_t run_group(zb_wstore_t *w, group_t *g) {
  zb_status_t st = ZB_OK;
  int k = 0;
  for (; k < g->n && st == ZB_OK; k++) {
    st = w->backend->ops->wgrad(w->backend, &g->entries[k]);
    if (st != ZB_OK) break;
    /* The host backend has finished the GEMM when wgrad returns; a device backend would hand the
     * token back only once its stream passed the GEMM. What the caller does then (adding a
     * half-precision product into .grad, say) is part of the W: if it fails, so does the W. */
    release_one(w, &g->entries[k], 1, &st);
  }
  /* The entries that did not run are still released, so the caller can free their tensors; the
   * first failure is what the call reports. */
  zb_status_t ignore = ZB_OK;
  for (; k < g->n; k++) release_one(w, &g->entries[k], 0, st == ZB_OK ? &st : &ignore);
  g->n = 0;
  g->next = w->spare;
  w->spare = g;
  return st;
}

zb_status_t zb_wstore_pop_run(zb_wstore_t *w, int32_t stage, int32_t *out_mb) {
  ZB_ARG_NOT_NULL(w);
  if (stage < 0 || stage >= w->n_stages || !w->fifo[stage].head)
    return ZB_FAIL(ZB_ERR_INVALID_SCHEDULE,
                   "W for stage %d: the W store has no pending group for that stage (a W op must "
                   "follow the B op of the same stage and microbatch)",
                   (int)stage);
  fifo_t *f = &w->fifo[stage];
  group_t *g = f->head;
  f->head = g->next;
  if (!f->head) f->tail = NULL;
  f->count--;
  if (out_mb) *out_mb = g->mb;
  return run_group(w, g);
}

zb_status_t zb__wstore_pop_run_mb(zb_wstore_t *w, int32_t stage, int32_t mb) {
  ZB_ARG_NOT_NULL(w);
  group_t *prev = NULL, *g = stage >= 0 && stage < w->n_stages ? w->fifo[stage].head : NULL;
  while (g && g->mb != mb) prev = g, g = g->next;
  if (!g)
    return ZB_FAIL(ZB_ERR_INVALID_SCHEDULE,
                   "W for stage %d, mb %d: the W store has no pending group for it (a W op must "
                   "follow the B op of the same stage and microbatch)",
                   (int)stage, (int)mb);
  fifo_t *f = &w->fifo[stage];
  if (prev) prev->next = g->next;
  else f->head = g->next;
  if (f->tail == g) f->tail = prev;
  f->count--;
  return run_group(w, g);
}

zb_status_t zb_wstore_pending(const zb_wstore_t *w, int32_t stage, int32_t *out_groups) {
  ZB_ARG_NOT_NULL(w);
  ZB_ARG_NOT_NULL(out_groups);
  int32_t n = 0;
  if (stage < 0) {
    for (int32_t s = 0; s < w->n_stages; s++) n += w->fifo[s].count;
  } else if (stage < w->n_stages) {
    n = w->fifo[stage].count;
  }
  *out_groups = n;
  return ZB_OK;
}
