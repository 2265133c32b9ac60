/*
 * replay_main.c - runs inputs through LLVMFuzzerTestOneInput without libFuzzer, so the fuzz target
 * and its seed corpus are exercised by every build (ctest's fuzz_csv_replay).
 *
 * Usage: fuzz_csv_replay PATH...  where each PATH is a file or a directory of files (not recursive).
 * A crash or trap is the failure; a clean run prints "replayed N inputs" and returns 0.
 *
 * What this is not: a fuzzer. It never mutates inputs.
 */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Returns 1 if the file was run, 0 if it could not be read (reported, and counted as a failure). */
static int replay_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    fprintf(stderr, "replay: cannot open %s\n", path);
    return 0;
  }
  size_t cap = 4096, len = 0;
  uint8_t *buf = malloc(cap);
  for (;;) {
    if (!buf) break;
    if (len == cap) {
      uint8_t *grown = realloc(buf, cap * 2);
      if (!grown) {
        free(buf);
        buf = NULL;
        break;
      }
      buf = grown;
      cap *= 2;
    }
    size_t got = fread(buf + len, 1, cap - len, f);
    len += got;
    if (got == 0) break;
  }
  int bad = ferror(f);
  fclose(f);
  if (!buf || bad) {
    fprintf(stderr, "replay: cannot read %s\n", path);
    free(buf);
    return 0;
  }
  /* Hand over an exact-size copy so a read past the end is caught by ASan, as under libFuzzer. */
  uint8_t *exact = malloc(len ? len : 1);
  if (!exact) {
    free(buf);
    fprintf(stderr, "replay: out of memory for %s\n", path);
    return 0;
  }
  if (len) memcpy(exact, buf, len);
  free(buf);
  LLVMFuzzerTestOneInput(exact, len);
  free(exact);
  return 1;
}

int main(int argc, char **argv) {
  long replayed = 0;
  int failures = 0;
  for (int i = 1; i < argc; i++) {
    struct stat st;
    if (stat(argv[i], &st) != 0) {
      fprintf(stderr, "replay: %s does not exist\n", argv[i]);
      failures++;
      continue;
    }
    if (!S_ISDIR(st.st_mode)) {
      if (replay_file(argv[i])) replayed++;
      else failures++;
      continue;
    }
    DIR *dir = opendir(argv[i]);
    if (!dir) {
      fprintf(stderr, "replay: cannot open directory %s\n", argv[i]);
      failures++;
      continue;
    }
    struct dirent *e;
    while ((e = readdir(dir)) != NULL) {
      size_t n = strlen(argv[i]) + strlen(e->d_name) + 2;
      char *path = malloc(n);
      if (!path) {
        failures++;
        break;
      }
      snprintf(path, n, "%s/%s", argv[i], e->d_name);
      struct stat fst;
      if (stat(path, &fst) == 0 && S_ISREG(fst.st_mode)) {
        if (replay_file(path)) replayed++;
        else failures++;
      }
      free(path);
    }
    closedir(dir);
  }
  printf("replayed %ld inputs\n", replayed);
  /* An unreadable input is not a crash, but a test that silently ran nothing would pass forever. */
  return failures ? 1 : 0;
}
