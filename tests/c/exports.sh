#!/bin/sh
# The shared library exports the zb_ API and nothing else (internal zb__ helpers, static code and
# third-party symbols stay hidden), and every function the public header declares is exported.
# Usage: sh exports.sh path/to/libzbpp.so path/to/include/zbpp.h
set -u
lib=$1
header=$2
exported=$(nm -D --defined-only "$lib" | awk '{print $3}' | sort)
bad=$(printf '%s\n' "$exported" | grep -v '^zb_[a-z]' || true)
fails=0
if [ -n "$bad" ]; then
  echo "FAIL: exported symbols outside the zb_ API:"
  printf '  %s\n' $bad
  fails=$((fails + 1))
fi
# Function names declared with ZB_API in the header.
declared=$(grep -o '^ZB_API [^(]*(' "$header" | sed 's/($//; s/.*[ *]//' | sort -u)
for f in $declared; do
  if ! printf '%s\n' "$exported" | grep -qx "$f"; then
    echo "FAIL: $f is declared in zbpp.h but not exported"
    fails=$((fails + 1))
  fi
done
n=$(printf '%s\n' "$declared" | wc -l)
if [ "$fails" -eq 0 ]; then
  echo "1 passed, 0 failed ($n declared functions exported, nothing else)"
  exit 0
fi
echo "0 passed, 1 failed"
exit 1
