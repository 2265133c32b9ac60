/*
 * fuzz_csv.c - libFuzzer target for the CSV import and everything downstream of it.
 *
 * Each input is read as torch compute_only CSV. What imports is validated; what validates is
 * simulated and written in every format. Independently of validity, the CSV export of what was
 * imported must import again and export to the same bytes (the round trip the tool promises).
 * A broken promise calls __builtin_trap() so the fuzzer records the input.
 *
 * What this is not: library code. It uses only the public API, traps on purpose, and is built both
 * with libFuzzer (ZB_FUZZ) and as a plain program that replays a corpus (replay_main.c).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "zbpp.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Larger inputs only repeat what small ones reach, and slow the fuzzer down. */
#define MAX_INPUT (64 * 1024)
/* Validation allocates tables of stages x microbatches whatever the op count; a single cell like
 * "65535F900" asks for tens of millions of entries. The library allows that (it matches
 * zb_schedule_create's limits), but it would only measure the fuzzer's memory limit here. */
#define MAX_CELLS_TO_VALIDATE (1L << 20)

#define CHECK(cond)                                                                                \
  do {                                                                                             \
    if (!(cond)) __builtin_trap();                                                                 \
  } while (0)

/* Import the CSV text, export it again; the export must be stable. */
static void check_round_trip(zb_schedule_t *s) {
  zb_schedule_info_t info;
  CHECK(zb_schedule_get_info(s, &info) == ZB_OK);
  /* Trailing blank lines are not ranks on import, so a schedule whose last rank has no ops (never a
   * valid one) comes back with fewer ranks. Every other schedule must survive the round trip. */
  const zb_op_t *ops;
  int32_t n;
  CHECK(zb_schedule_rank_ops(s, info.ranks - 1, &ops, &n) == ZB_OK);
  char *first = NULL, *second = NULL;
  size_t first_len = 0, second_len = 0;
  zb_status_t st = zb_schedule_export(s, ZB_FORMAT_CSV, &first, &first_len);
  if (st == ZB_ERR_OUT_OF_MEMORY) return;
  CHECK(st == ZB_OK && first && strlen(first) == first_len);
  if (n > 0) {
    zb_schedule_t *again = NULL;
    st = zb_schedule_import(&again, ZB_FORMAT_CSV, first, first_len, NULL);
    if (st != ZB_ERR_OUT_OF_MEMORY) {
      CHECK(st == ZB_OK);
      zb_schedule_info_t info2;
      CHECK(zb_schedule_get_info(again, &info2) == ZB_OK);
      CHECK(info2.ranks == info.ranks && info2.chunks == info.chunks &&
            info2.microbatches == info.microbatches && info2.placement == info.placement);
      st = zb_schedule_export(again, ZB_FORMAT_CSV, &second, &second_len);
      if (st != ZB_ERR_OUT_OF_MEMORY) {
        CHECK(st == ZB_OK);
        CHECK(second_len == first_len && memcmp(first, second, first_len) == 0);
      }
      zb_free(second);
      zb_schedule_destroy(again);
    }
  }
  zb_free(first);
}

static void check_valid(zb_schedule_t *s) {
  zb_sim_result_t res;
  zb_status_t st = zb_schedule_simulate(s, &res);
  if (st == ZB_ERR_OUT_OF_MEMORY) return;
  /* The validator accepted it, so it runs: a disagreement is a bug in one of them. */
  CHECK(st == ZB_OK);
  CHECK(res.cost >= 0 && res.bubble_rate >= 0 && res.bubble_rate <= 1);
  const zb_format_t formats[] = {ZB_FORMAT_TEXT, ZB_FORMAT_CSV, ZB_FORMAT_JSON, ZB_FORMAT_CHROME,
                                 ZB_FORMAT_SVG, ZB_FORMAT_CSV_COMMS};
  for (size_t i = 0; i < sizeof formats / sizeof formats[0]; i++) {
    char *text = NULL;
    size_t len = 0;
    st = zb_schedule_export(s, formats[i], &text, &len);
    if (st == ZB_ERR_OUT_OF_MEMORY) continue;
    CHECK(st == ZB_OK && text && strlen(text) == len && len > 0);
    zb_free(text);
  }
  /* The offload pass on a valid schedule gives a valid one (or refuses one that has copies). */
  zb_schedule_t *off = NULL;
  st = zb_schedule_plan_offload(&off, s, NULL);
  if (st == ZB_OK) {
    st = zb_schedule_validate(off);
    CHECK(st == ZB_OK || st == ZB_ERR_OUT_OF_MEMORY);
    zb_schedule_destroy(off);
  } else {
    CHECK(st == ZB_ERR_INVALID_ARGUMENT || st == ZB_ERR_OUT_OF_MEMORY);
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size > MAX_INPUT) return 0;
  zb_schedule_t *s = NULL;
  zb_status_t st = zb_schedule_import(&s, ZB_FORMAT_CSV, (const char *)data, size, NULL);
  if (st != ZB_OK) {
    /* A rejected input must leave no handle and a message behind. */
    CHECK(s == NULL && zb_last_error()[0] != '\0');
    return 0;
  }
  CHECK(s != NULL);
  check_round_trip(s);
  zb_schedule_info_t info;
  CHECK(zb_schedule_get_info(s, &info) == ZB_OK);
  if ((long)info.stages * info.microbatches <= MAX_CELLS_TO_VALIDATE) {
    st = zb_schedule_validate(s);
    if (st == ZB_OK) check_valid(s);
    else CHECK(st == ZB_ERR_INVALID_SCHEDULE || st == ZB_ERR_OUT_OF_MEMORY);
  }
  zb_schedule_destroy(s);
  return 0;
}
