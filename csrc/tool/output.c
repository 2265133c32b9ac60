/*
 * output.c - what the zbpp tool puts in front of a user: library messages without the C source
 * positions in them, and -o files that are written whole or not at all.
 *
 * A file given with -o is written to a temporary file next to it (FILE.XXXXXX, so the same file
 * system) and renamed over FILE only once every byte is written, flushed and closed. A write that
 * fails part-way (disk full, quota, a file-size limit, an I/O error) removes the temporary and
 * leaves FILE as it was: the old plan a user asked to replace is never lost to a half-written one.
 *
 * What this is not: durable against a power cut in every file system's sense; the data are synced
 * before the rename, the folder is not. And a FILE that is a hard link is replaced, not written
 * through (its other names keep the old content), as with any editor's safe save.
 */
#define _XOPEN_SOURCE 700 /* realpath, mkstemp, fchmod, fchown */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tool.h"
#include "zbpp.h"

/* ---- messages ---------------------------------------------------------------------------------- */

static int name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '-' || c == '+' || c == '.';
}

/* The length of "name.c:123: " at s (also .cu, .cpp, .cc, .h), or 0 when s does not start with one. */
static size_t source_pos_len(const char *s) {
  size_t n = 0;
  while (name_char(s[n])) n++;
  static const char *const exts[] = {".c", ".cu", ".cpp", ".cc", ".h"};
  int is_source = 0;
  for (size_t k = 0; k < sizeof exts / sizeof exts[0]; k++) {
    size_t e = strlen(exts[k]);
    if (n > e && !strncmp(s + n - e, exts[k], e)) is_source = 1;
  }
  if (!is_source || s[n] != ':' || s[n + 1] < '0' || s[n + 1] > '9') return 0;
  n++;
  while (s[n] >= '0' && s[n] <= '9') n++;
  if (s[n] != ':') return 0;
  n++;
  return s[n] == ' ' ? n + 1 : n;
}

const char *zb__tool_plain(const char *msg) {
  /* zb_last_error() starts with "file.c:123: " for developers, and a message that quotes another
   * (a rank's failure inside the runner's) carries more of them inside: drop every one. */
  static char buf[4096];
  size_t o = 0;
  if (!msg) return "";
  for (size_t i = 0; msg[i] && o + 1 < sizeof buf;) {
    size_t skip = (i == 0 || !name_char(msg[i - 1])) ? source_pos_len(msg + i) : 0;
    if (skip) {
      i += skip;
    } else {
      buf[o++] = msg[i++];
    }
  }
  buf[o] = '\0';
  return buf;
}

const char *zb__tool_error(void) { return zb__tool_plain(zb_last_error()); }

/* ---- -o files ---------------------------------------------------------------------------------- */

/* Writes all of data to fd; 0, or -1 with errno set. */
static int write_all(int fd, const char *data, size_t len) {
  while (len > 0) {
    ssize_t n = write(fd, data, len);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return -1;
    if (n == 0) { /* write(2) never does this for a regular file; do not loop forever if it does */
      errno = EIO;
      return -1;
    }
    data += n;
    len -= (size_t)n;
  }
  return 0;
}

/* A path that is not a regular file (a terminal, /dev/null, a pipe): there is nothing on it to
 * keep, and a rename would replace the device node itself, so it is written in place. */
static int write_in_place(const char *path, const char *data, size_t len) {
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0666);
  if (fd < 0) {
    fprintf(stderr, "zbpp: cannot write '%s': %s\n", path, strerror(errno));
    return 1;
  }
  int failed = write_all(fd, data, len) != 0;
  int err = errno;
  if (close(fd) != 0 && !failed) failed = 1, err = errno;
  if (failed) {
    fprintf(stderr, "zbpp: writing '%s' failed: %s\n", path, strerror(err));
    return 1;
  }
  return 0;
}

int zb__tool_write_file(const char *path, const char *data, size_t len) {
  /* Through a symbolic link, to what it points at, as fopen would write: replacing the link by a
   * plain file would cut it. A dangling link has nothing to protect; it is written in place, which
   * creates its target as fopen would. */
  struct stat st;
  char *resolved = NULL;
  const char *target = path;
  if (lstat(path, &st) == 0 && S_ISLNK(st.st_mode)) {
    resolved = realpath(path, NULL);
    if (!resolved) return write_in_place(path, data, len);
    target = resolved;
  }
  int exists = stat(target, &st) == 0;
  if (exists && !S_ISREG(st.st_mode)) {
    int rc = write_in_place(target, data, len);
    free(resolved);
    return rc;
  }
  /* The new file gets what fopen would leave: an existing file's mode (and owner, where we may set
   * it), else 0666 less the umask. */
  mode_t mode;
  if (exists) {
    mode = st.st_mode & 07777;
  } else {
    mode_t mask = umask(0);
    umask(mask);
    mode = 0666 & ~mask;
  }

  char *tmp = malloc(strlen(target) + sizeof ".XXXXXX");
  const char *what = NULL; /* the step that failed */
  int err = 0, fd = -1;
  if (!tmp) {
    what = "out of memory", err = ENOMEM;
  } else {
    strcpy(tmp, target);
    strcat(tmp, ".XXXXXX");
    fd = mkstemp(tmp);
    if (fd < 0) what = "cannot create a temporary file next to it", err = errno;
  }
  if (!what && fchmod(fd, mode) != 0) what = "cannot set the temporary file's permissions", err = errno;
  if (!what && exists && (st.st_uid != geteuid() || st.st_gid != getegid())) {
    if (fchown(fd, st.st_uid, st.st_gid) != 0) {
      /* Only a privileged user can give the file back to its owner; others keep it as theirs,
       * as after deleting and re-creating it. Not a reason to fail. */
    }
  }
  if (!what && write_all(fd, data, len) != 0) what = "cannot write", err = errno;
  /* A file system may not support fsync (EINVAL); the data are then as safe as it makes them. */
  if (!what && fsync(fd) != 0 && errno != EINVAL && errno != ENOTSUP)
    what = "cannot flush", err = errno;
  if (fd >= 0 && close(fd) != 0 && !what) what = "cannot close", err = errno;
  if (!what && rename(tmp, target) != 0) what = "cannot replace it", err = errno;
  if (what) {
    if (fd >= 0) unlink(tmp);
    if (exists)
      fprintf(stderr, "zbpp: writing '%s' failed (%s: %s); '%s' was left unchanged\n", path, what,
              strerror(err), path);
    else
      fprintf(stderr, "zbpp: writing '%s' failed (%s: %s); no file was made\n", path, what,
              strerror(err));
  }
  free(tmp);
  free(resolved);
  return what ? 1 : 0;
}
