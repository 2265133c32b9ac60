#!/bin/sh
# tool_cli.sh - the `zbpp` command-line tool as a user runs it: help and version, the output
# formats (text, JSON, CSV round trip, Chrome trace, SVG), and bad input that must end in a clear
# message and a non-zero exit, never a crash or a hang.
#
#   sh tool_cli.sh /path/to/zbpp /path/to/repo
#
# What this is not: a test of the schedules' shapes or the exporters' details; the C tests cover
# those through the library. Expected values come from the tool's documented behaviour (--help,
# DESIGN.md section 3), not from earlier runs of the tool.
set -u

if [ $# -ne 2 ]; then
  echo "usage: sh $0 /path/to/zbpp /path/to/repo" >&2
  exit 2
fi
ZBPP=$1
REPO=$2
if [ ! -x "$ZBPP" ]; then
  echo "tool_cli: '$ZBPP' is not an executable" >&2
  exit 2
fi

T=$(mktemp -d "${TMPDIR:-/tmp}/zbpp_cli.XXXXXX") || exit 2
trap 'rm -rf "$T"' EXIT
trap 'exit 2' HUP INT TERM

PASSED=0
FAILED=0

ok() { PASSED=$((PASSED + 1)); }
bad() { # bad DESCRIPTION EXPECTED GOT
  FAILED=$((FAILED + 1))
  printf 'FAIL: %s\n  expected: %s\n  got:      %s\n' "$1" "$2" "$3"
}

# Runs the tool with a time limit; sets RC and leaves stdout in $T/out and stderr in $T/err.
run() {
  timeout 20 "$ZBPP" "$@" >"$T/out" 2>"$T/err"
  RC=$?
}

# What a failing check shows of a file: its first lines.
show() { head -c 600 "$1" 2>/dev/null | tr '\n' '|'; }

check_eq() { # check_eq DESCRIPTION EXPECTED GOT
  if [ "$2" = "$3" ]; then ok; else bad "$1" "$2" "$3"; fi
}

check_rc() { # check_rc DESCRIPTION WANT_RC (after run)
  if [ "$RC" -eq "$2" ]; then ok; else bad "$1: exit code" "$2" "$RC; stderr: $(show "$T/err")"; fi
}

check_grep() { # check_grep DESCRIPTION FILE FIXED_STRING
  if grep -q -F -e "$3" "$2"; then ok; else bad "$1" "'$3' in $(basename "$2")" "$(show "$2")"; fi
}

check_grep_i() { # the same, ignoring case
  if grep -q -i -F -e "$3" "$2"; then ok; else bad "$1" "'$3' in $(basename "$2")" "$(show "$2")"; fi
}

check_empty() { # check_empty DESCRIPTION FILE
  if [ ! -s "$2" ]; then ok; else bad "$1" "nothing" "$(show "$2")"; fi
}

# check_no_source_pos DESCRIPTION FILE: the library's "file.c:123: " (zb_last_error's position, for
# developers) must not reach a user's terminal.
check_no_source_pos() {
  if grep -q -E '[A-Za-z0-9_]\.(c|cu|cpp|h):[0-9]' "$2"; then
    bad "$1: no C source position in the message" "no 'file.c:NNN'" "$(show "$2")"
  else ok; fi
}

# expect_error DESCRIPTION WANT_RC NEEDLE ARGS...: a clean failure. WANT_RC is a number or 'any';
# any failure must exit 1..123 (124 is timeout's, 128+ a signal: a hang or a crash), print nothing
# on stdout, and say on stderr what was wrong (NEEDLE, case-insensitive; '' for any message).
expect_error() {
  e_desc=$1
  e_rc=$2
  e_needle=$3
  shift 3
  run "$@"
  if [ "$RC" -ge 124 ]; then
    bad "$e_desc: no crash or hang" "exit code 1..123" "$RC (124 = timed out, 128+N = signal N)"
    return
  fi
  if [ "$e_rc" = any ]; then
    if [ "$RC" -ne 0 ]; then ok; else bad "$e_desc: exit code" "non-zero" "0"; fi
  else
    check_rc "$e_desc" "$e_rc"
  fi
  if [ -s "$T/err" ]; then ok; else bad "$e_desc: message on stderr" "a message" "nothing"; fi
  if [ -n "$e_needle" ]; then check_grep_i "$e_desc: message names the problem" "$T/err" "$e_needle"; fi
  check_empty "$e_desc: nothing on stdout" "$T/out"
  check_no_source_pos "$e_desc" "$T/err"
}

# ---- help and version --------------------------------------------------------------------------

run --help
check_rc "--help" 0
for kind in gpipe 1f1b interleaved-1f1b zb-h1 zb-h2 zb-v v-half v-min zb-auto; do
  if grep -q -E "^ +$kind( |\$)" "$T/out"; then ok; else
    bad "--help lists kind $kind on its own line" "a line '  $kind ...'" "$(show "$T/out")"
  fi
done
if grep -q -E "^ +custom( |\$)" "$T/out"; then
  bad "--help does not offer 'custom' (it cannot be generated)" "no 'custom' line" "$(show "$T/out")"
else ok; fi

check_grep "--help says where each command's options are" "$T/out" "zbpp COMMAND --help"

# Each command's --help is its own: its usage line and options, not the global text.
run schedule --help
check_rc "schedule --help" 0
check_grep "schedule --help starts with its usage" "$T/out" "Usage: zbpp schedule KIND"
check_grep "schedule --help lists its options" "$T/out" "--stage-times FILE"
check_grep "schedule --help lists the kinds" "$T/out" "zb-auto"
if grep -q -F "zbpp bench [options]" "$T/out"; then
  bad "schedule --help is not the global help" "no other commands' usage" "$(show "$T/out")"
else ok; fi
run simulate --help
check_rc "simulate --help" 0
check_grep "simulate --help starts with its usage" "$T/out" "Usage: zbpp simulate FILE.csv"
if grep -q -E "^ +-p, --ranks" "$T/out"; then
  bad "simulate --help does not offer -p (the file has the ranks)" "no -p line" "$(show "$T/out")"
else ok; fi
expect_error "schedule with a bad option points at schedule --help" 2 "zbpp schedule --help" \
  schedule zb-v -p 4 -m 8 --bogus

# A reader that closes the pipe early: a quiet exit, status 0 (pipefail-safe), nothing on stderr.
{ timeout 20 "$ZBPP" schedule zb-auto -p 8 -m 400 2>"$T/err"; echo $? >"$T/rc"; } | head -c 1 >/dev/null
check_eq "a closed pipe ends the tool with status 0" 0 "$(cat "$T/rc")"
check_empty "a closed pipe: nothing on stderr" "$T/err"

MAJOR=$(sed -n 's/^#define ZB_VERSION_MAJOR \([0-9][0-9]*\).*/\1/p' "$REPO/include/zbpp.h")
MINOR=$(sed -n 's/^#define ZB_VERSION_MINOR \([0-9][0-9]*\).*/\1/p' "$REPO/include/zbpp.h")
PATCH=$(sed -n 's/^#define ZB_VERSION_PATCH \([0-9][0-9]*\).*/\1/p' "$REPO/include/zbpp.h")
run --version
check_rc "--version" 0
check_grep "--version prints the header's version" "$T/out" "$MAJOR.$MINOR.$PATCH"

# ---- text --------------------------------------------------------------------------------------

run schedule zb-v -p 4 -m 8
check_rc "schedule zb-v -p 4 -m 8" 0
check_eq "text grid has one line per rank" 4 "$(grep -c '^rank ' "$T/out")"
check_grep "zb-v at m = 2p has no bubble" "$T/out" "bubble 0.00%"
# ... by the paper's rate; its fill and drain are idle time of the step, which the line also gives:
# 4 ranks over the makespan 25.5 (F = B = W = 1, each of the 2 chunks' ops 0.5) doing 24 each.
check_grep "zb-v at m = 2p: the step's idle share (1 - 4*24 / (4*25.5))" "$T/out" "idle 5.88%"

# ---- JSON --------------------------------------------------------------------------------------

PY=/usr/bin/python3
if [ ! -x "$PY" ]; then
  echo "note: $PY is missing; skipping the JSON checks"
else
  # check.py FILE [DURATION] [MEM_LIMIT]: prints what is wrong, nothing if the file is right.
  cat >"$T/check.py" <<'EOF'
import json, sys
path = sys.argv[1]
want_dur = float(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] != "-" else None
want_limit = sys.argv[3] if len(sys.argv) > 3 else None
try:
    d = json.load(open(path))
except Exception as e:
    print("not JSON: %s" % e); sys.exit(0)
keys = {"kind", "ranks", "chunks", "stages", "microbatches", "placement", "w_share", "mem_limit",
        "schedule", "cost", "bubble_rate", "peak_memory", "makespan", "idle_rate", "name", "time_unit"}
if set(d) != keys:
    print("keys %s, expected %s" % (sorted(d), sorted(keys))); sys.exit(0)
p, S, m = d["ranks"], d["stages"], d["microbatches"]
# The step's figures, recomputed from the ops: the makespan over every rank, and the idle share of
# all ranks' time over it.
ops = [o for rank in d["schedule"] for o in rank]
span = max(o["end"] for o in ops) - min(o["start"] for o in ops)
idle = 1 - sum(o["end"] - o["start"] for o in ops) / (p * span)
if abs(d["makespan"] - span) > 1e-9 or abs(d["idle_rate"] - idle) > 1e-9:
    print("makespan %r, idle_rate %r; the ops say %r, %r" % (d["makespan"], d["idle_rate"], span, idle)); sys.exit(0)
if len(d["schedule"]) != p:
    print("schedule has %d lists for %d ranks" % (len(d["schedule"]), p))
seen = {}
for r, ops in enumerate(d["schedule"]):
    for o in ops:
        if set(o) != {"op", "stage", "mb", "start", "end"}:
            print("rank %d: op keys %s" % (r, sorted(o))); sys.exit(0)
        k = (o["op"], o["stage"], o["mb"])
        seen[k] = seen.get(k, 0) + 1
        if want_dur is not None and abs(o["end"] - o["start"] - want_dur) > 1e-9:
            print("rank %d: %s lasts %r, expected %r" % (r, k, o["end"] - o["start"], want_dur))
            sys.exit(0)
for s in range(S):
    for i in range(m):
        for t in "FBW":
            if seen.get((t, s, i), 0) != 1:
                print("(stage %d, mb %d) has %d %s ops, expected 1" % (s, i, seen.get((t, s, i), 0), t))
                sys.exit(0)
if sum(seen.values()) != 3 * S * m:
    print("%d ops, expected 3*S*m = %d" % (sum(seen.values()), 3 * S * m))
if want_limit is not None:
    got = d["mem_limit"]
    if want_limit == "null" and got is not None:
        print("mem_limit is %r, expected null" % got)
    if want_limit != "null" and (got is None or abs(got - float(want_limit)) > 1e-9):
        print("mem_limit is %r, expected %s" % (got, want_limit))
EOF
  json_check() { # json_check DESCRIPTION [DURATION] [MEM_LIMIT]  (on $T/out)
    j_desc=$1
    shift
    j_msg=$("$PY" "$T/check.py" "$T/out" "$@" 2>&1)
    if [ -z "$j_msg" ]; then ok; else bad "$j_desc" "a well-formed schedule" "$j_msg"; fi
  }

  run schedule zb-h1 -p 4 -m 8 --format json
  check_rc "schedule zb-h1 --format json" 0
  json_check "zb-h1 JSON (unit times: every op lasts 1, no limit)" 1 null

  run schedule zb-h1 -p 4 -m 8 --format json --mem-limit 2p
  check_rc "schedule zb-h1 --mem-limit 2p --format json" 0
  json_check "zb-h1 JSON with --mem-limit 2p (limit 8)" 1 8

  # --times is per rank: with v = 2 each op takes half.
  run schedule zb-v -p 2 -m 4 --times 2,2,2 --format json
  check_rc "schedule zb-v --times 2,2,2 --format json" 0
  json_check "zb-v --times 2,2,2: every op lasts 1.0" 1.0 null

  # A torch-style compute_only CSV: idle cells, I (input backward), W, and B (full backward).
  printf '0F0,0F1,,0B0,,0B1\n,1F0,1I0,1F1,1I1,1W0,1W1\n' >"$T/torch.csv"
  run simulate "$T/torch.csv" --format json
  check_rc "simulate a torch-style CSV" 0
  TYPES=$("$PY" -c 'import json,sys; d=json.load(open(sys.argv[1])); print(" ".join("".join(sorted(set(o["op"] for o in ops))) for ops in d["schedule"]))' "$T/out" 2>&1 | tail -n 1)
  check_eq "torch CSV: rank 0 fused backward (B), rank 1 split (I and W)" "BWF BFW" "$TYPES"
fi

# A torch-style CSV in the default (text) format too, so it is covered without python.
printf '0F0,0F1,,0B0,,0B1\n,1F0,1I0,1F1,1I1,1W0,1W1\n' >"$T/torch.csv"
run simulate "$T/torch.csv"
check_rc "simulate a torch-style CSV (text)" 0
check_eq "torch CSV: two ranks in the grid" 2 "$(grep -c '^rank ' "$T/out")"

# torch's compute_comms form out, and back in: the transfers are read and dropped.
run schedule zb-v -p 2 -m 4 --format csv-comms -o "$T/comms.csv"
check_rc "schedule zb-v --format csv-comms" 0
check_grep "csv-comms has torch's sends" "$T/comms.csv" "0SEND_F0"
check_grep "csv-comms has torch's receives" "$T/comms.csv" "1RECV_F0"
run schedule zb-v -p 2 -m 4 --format csv -o "$T/plain.csv"
run simulate "$T/comms.csv" --format csv
check_rc "simulate a csv-comms file" 0
check_eq "csv-comms reads back to the compute-only plan" "$(cat "$T/plain.csv")" "$(cat "$T/out")"

# ---- CSV round trip through files -------------------------------------------------------------

run schedule 1f1b -p 4 -m 8 --format csv -o "$T/a.csv"
check_rc "schedule 1f1b --format csv -o a.csv" 0
check_empty "-o: nothing on stdout" "$T/out"
check_grep "-o: a summary on stderr" "$T/err" "wrote"
check_eq "a.csv has one row per rank" 4 "$(grep -c . "$T/a.csv" 2>/dev/null)"
run simulate "$T/a.csv" --format csv -o "$T/b.csv"
check_rc "simulate a.csv --format csv -o b.csv" 0
check_empty "simulate -o: nothing on stdout" "$T/out"
check_grep "simulate -o: a summary on stderr" "$T/err" "wrote"
if cmp -s "$T/a.csv" "$T/b.csv"; then ok; else
  bad "CSV survives a round trip" "b.csv identical to a.csv" "$(show "$T/a.csv") vs $(show "$T/b.csv")"
fi

# ---- Chrome trace and SVG ----------------------------------------------------------------------

run schedule zb-h2 -p 4 -m 8 --format chrome
check_rc "--format chrome" 0
check_grep "chrome trace has traceEvents" "$T/out" "traceEvents"
if [ -x "${PY:-}" ]; then
  if "$PY" -c 'import json,sys; json.load(open(sys.argv[1]))' "$T/out" 2>"$T/pyerr"; then ok; else
    bad "chrome trace parses as JSON" "valid JSON" "$(show "$T/pyerr")"
  fi
fi

run schedule v-half -p 4 -m 8 --format svg
check_rc "--format svg" 0
FIRST=$(head -c 5 "$T/out")
case "$FIRST" in
  "<svg"* | "<?xml") ok ;;
  *) bad "svg output starts like SVG" "<svg or <?xml" "$FIRST" ;;
esac
check_grep "svg output is closed" "$T/out" "</svg>"

# ---- bad input ---------------------------------------------------------------------------------

expect_error "-p 0" 1 "ranks" schedule 1f1b -p 0 -m 8
expect_error "-m -1" any "microbatches" schedule 1f1b -p 4 -m -1
expect_error "unknown kind" 2 "zb-v" schedule nope -p 4 -m 8
check_grep "unknown kind: message names the kind given" "$T/err" "nope"
check_grep "unknown kind: message lists 1f1b" "$T/err" "1f1b"
expect_error "-v 3 for zb-v" any "v = 3" schedule zb-v -p 4 -m 8 -v 3
run schedule zb-auto -p 2 -m 4 -v 3 --placement loop --format csv
check_rc "zb-auto with 3 loop-placed stages per rank" 0
check_eq "rank 0 holds stage 4 (loop placement: s mod p)" 1 "$(head -1 "$T/out" | grep -c 4F0)"
expect_error "zb-auto -v 3 without a placement" 1 "set placement to loop" schedule zb-auto -p 2 -m 4 -v 3
expect_error "--placement for a fixed kind" 1 "only zb-auto" schedule zb-h1 -p 2 -m 4 --placement v
expect_error "a bad --placement" 2 "loop or v" schedule zb-h1 -p 2 -m 4 --placement ring
printf '{"format": "zbpp-costs", "version": 1, "ranks": 2, "chunks": 2, "placement": "loop", "time_f": [1, 1, 1, 1], "time_b": [1, 1, 1, 1], "time_w": [0.5, 0.5, 0.5, 0.5]}\n' > "$T/loop2.json"
run schedule zb-auto -p 2 -m 4 -v 2 --stage-times "$T/loop2.json" --format csv
check_rc "zb-auto plans for the cost file's loop placement" 0
check_eq "stage 2 on rank 0 (loop, not V)" 1 "$(head -1 "$T/out" | grep -c 2F0)"
expect_error "interleaved-1f1b -p 4 -m 9 (2 rounds do not divide 9)" any "multiple" schedule interleaved-1f1b -p 4 -m 9
expect_error "--times with two values" 2 "--times" schedule 1f1b -p 4 -m 8 --times 1,2
expect_error "--times with a non-number" any "--times" schedule 1f1b -p 4 -m 8 --times 1,x,3
expect_error "--comm nan" any "comm" schedule 1f1b -p 4 -m 8 --comm nan
expect_error "--w-share 2" any "w_share" schedule zb-h1 -p 4 -m 8 --w-share 2
expect_error "zb-auto --mem-limit 0.5" 1 "minimum is 1" schedule zb-auto -p 4 -m 8 --mem-limit 0.5
# ZB-H2 needs 2p-1 = 7 microbatches of activations: a limit of 2 breaks the memory rule.
expect_error "zb-h2 --mem-limit 2" 1 "memory" schedule zb-h2 -p 4 -m 8 --mem-limit 2
check_grep_i "zb-h2 --mem-limit 2: message names the limit" "$T/err" "limit"
expect_error "missing -p" 2 "-p" schedule 1f1b -m 8
expect_error "unknown command" 2 "schedule" frobnicate

printf '0F0,0F' >"$T/trunc.csv"
expect_error "truncated CSV" 1 "0F" simulate "$T/trunc.csv"
expect_error "missing file" 1 "no-such-file.csv" simulate "$T/no-such-file.csv"
printf '' >"$T/empty.csv"
expect_error "empty CSV" 1 "empty" simulate "$T/empty.csv"
# Rank 1 runs the backward of stage 1 before its forward: a dependency out of order.
printf '0F0,0B0\n1B0,1F0\n' >"$T/broken.csv"
expect_error "CSV that breaks a rule" 1 "rank" simulate "$T/broken.csv"
# Stage 1's ops on both rows: no stage-to-rank map fits, so loop placement is assumed, where
# stage 1 lives on rank 1, not on rank 0 (the first row). (Rows that only swap stages are a map.)
printf '0F0,1F0,1B0,0B0\n1F0,1B0\n' >"$T/wrong_rank.csv"
expect_error "CSV with an op on the wrong rank" 1 "rank" simulate "$T/wrong_rank.csv"

expect_error "unknown option" 2 "--bogus" schedule 1f1b -p 4 -m 8 --bogus
expect_error "--format png" 2 "png" schedule 1f1b -p 4 -m 8 --format png
check_grep "--format png: message lists the formats" "$T/err" "svg"
expect_error "-o into a missing directory" 1 "no-such-dir" schedule 1f1b -p 2 -m 2 -o "$T/no-such-dir/x.txt"

# ---- numbers that must not silently mean "the default" ------------------------------------------

expect_error "-v 0" 2 "-v" schedule zb-v -p 2 -m 4 -v 0
check_grep "-v 0: message says what is allowed" "$T/err" ">= 1"
expect_error "-v -1" 2 "-v" schedule 1f1b -p 2 -m 4 -v -1
expect_error "-v junk" 2 "-v" schedule 1f1b -p 2 -m 4 -v two
expect_error "--times with BW 0 (the library's 'B + W')" 2 "BW" schedule 1f1b -p 2 -m 4 --times 1,1,1,0
expect_error "verify -v 0" 2 "-v" verify zb-v -p 2 -m 4 -v 0
expect_error "verify --ffn 0" 2 "--ffn" verify 1f1b -p 2 -m 2 --ffn 0
expect_error "verify --clip 0" 2 "--clip" verify 1f1b -p 2 -m 2 --clip 0
expect_error "verify --timeout 0" 2 "--timeout" verify 1f1b -p 2 -m 2 --timeout 0
expect_error "verify --inject-nan -2" 2 "--inject-nan" verify 1f1b -p 2 -m 2 --inject-nan -2
expect_error "bench -m -5" 2 "-m" bench -p 2 -m -5
expect_error "bench --ffn 0" 2 "--ffn" bench -p 2 --ffn 0

# ---- costs whose schedule would not have a finite length ----------------------------------------

# Each value is finite, but m times their sum is not: the plan's cost would be inf and its bubble NaN.
expect_error "--times 1e308" 1 "1e+308" schedule 1f1b -p 4 -m 8 --times 1e308,1,1
check_grep_i "--times 1e308: message says what is allowed" "$T/err" "finite"
expect_error "zb-auto --times 1e308" 1 "1e+308" schedule zb-auto -p 4 -m 8 --times 1e308,1,1
if grep -q -i "stalled" "$T/err"; then bad "zb-auto --times 1e308: the costs, not the scheduler, are blamed" "no 'stalled'" "$(show "$T/err")"; else ok; fi
expect_error "--comm 1e308" 1 "time_comm" schedule zb-v -p 4 -m 8 --comm 1e308
expect_error "--times -1,1,1" 1 "time_f" schedule 1f1b -p 4 -m 8 --times -1,1,1
printf '{"format": "zbpp-costs", "version": 1, "time_f": [1, 1e308], "time_b": [1, 1], "time_w": [1, 1]}\n' >"$T/huge.json"
expect_error "--stage-times with 1e308" 1 "stage_time_f[1]" schedule 1f1b -p 2 -m 4 --stage-times "$T/huge.json"
printf '0F0,0I0,0W0\n' >"$T/one.csv"
expect_error "simulate --times 1e308,1e308,1e308" 1 "1e+308" simulate "$T/one.csv" --times 1e308,1e308,1e308

# ---- -o: the whole new file, or the old file untouched ------------------------------------------

mkdir "$T/o"
printf 'the old content\n' >"$T/o/plan.svg"
cp "$T/o/plan.svg" "$T/old.svg"
run schedule zb-h1 -p 2 -m 4 --format svg -o "$T/o/plan.svg"
check_rc "-o over an existing file" 0
check_grep "-o over an existing file: the new content" "$T/o/plan.svg" "</svg>"
check_eq "-o leaves nothing else in the folder" "plan.svg" "$(ls -A "$T/o" | tr '\n' ' ' | sed 's/ $//')"
chmod 640 "$T/o/plan.svg"
run schedule zb-h1 -p 2 -m 4 --format csv -o "$T/o/plan.svg"
check_eq "-o keeps an existing file's permissions" "-rw-r-----" "$(ls -l "$T/o/plan.svg" | cut -c1-10)"
(umask 027 && timeout 20 "$ZBPP" schedule zb-h1 -p 2 -m 4 --format csv -o "$T/o/new.csv") >"$T/out" 2>"$T/err"
check_eq "-o makes a new file 0666 less the umask, as fopen would" "-rw-r-----" "$(ls -l "$T/o/new.csv" 2>/dev/null | cut -c1-10)"
rm -f "$T/o/new.csv"
run schedule zb-h1 -p 2 -m 4 -o /dev/null
check_rc "-o /dev/null (not a regular file: written in place)" 0

# A file-size limit (ulimit -f, 512-byte blocks in sh) makes the write fail part-way: the tool must
# say so, exit 1 (not die of SIGXFSZ), and leave the old file as it was, with no temporary behind.
cp "$T/old.svg" "$T/o/plan.svg"
(ulimit -f 1 && exec timeout 20 "$ZBPP" schedule zb-h1 -p 8 -m 64 --format svg -o "$T/o/plan.svg") >"$T/out" 2>"$T/err"
RC=$?
check_rc "-o past a file-size limit" 1
check_grep "-o past a file-size limit: the reason" "$T/err" "$(printf '%s' "File too large")"
check_grep_i "-o past a file-size limit: the old file is kept" "$T/err" "left unchanged"
check_no_source_pos "-o past a file-size limit" "$T/err"
if cmp -s "$T/o/plan.svg" "$T/old.svg"; then ok; else
  bad "-o past a file-size limit: the file keeps its old content" "$(show "$T/old.svg")" "$(show "$T/o/plan.svg")"
fi
check_eq "-o past a file-size limit: no temporary left" "plan.svg" "$(ls -A "$T/o" | tr '\n' ' ' | sed 's/ $//')"

# ---- verify and bench ---------------------------------------------------------------------------

# verify: the pipelined run equals the sequential loop, exit 0, and --json ends with one JSON line
# carrying the fields docs/tool.md documents.
run verify zb-v -p 2 -m 4 --steps 2 --json
check_rc "verify zb-v exits 0 when equal" 0
check_grep "verify reports bit-for-bit equality" "$T/out" "bit-for-bit equal"
tail -n 1 "$T/out" >"$T/last"
for field in '"kind": "zb-v"' '"steps": 2' '"bitwise_equal": true' '"max_abs_diff": 0' '"losses": [' '"rolled_back_steps": 0'; do
  check_grep "verify --json has $field" "$T/last" "$field"
done
# A NaN at step 1 on the last stage, with post-validation: one step skipped and rolled back, and
# still bit-for-bit equal to the synchronous sequential loop.
run verify 1f1b -p 2 -m 2 --steps 3 --post-validation --inject-nan 1 --json
check_rc "verify with an injected NaN exits 0" 0
tail -n 1 "$T/out" >"$T/last"
check_grep "injected NaN: one rolled-back step" "$T/last" '"rolled_back_steps": 1'
check_grep "injected NaN: one skipped step" "$T/last" '"skipped_steps": 1'
check_grep "injected NaN: still equal" "$T/last" '"bitwise_equal": true'
expect_error "verify without -m" 2 "-m" verify zb-v -p 2
expect_error "verify with a bad optimizer" 2 "sgd or adamw" verify 1f1b -p 2 -m 2 --optimizer lamb
expect_error "verify --inject-nan past the last step" 2 "--inject-nan" verify 1f1b -p 2 -m 2 --steps 2 --inject-nan 2
expect_error "verify with m that torch's rounds do not divide, for interleaved" 1 "multiple" verify interleaved-1f1b -p 4 -m 9
# Offload (PipeOffload): 1F1B holds p - r microbatches on rank r; with copies of a quarter of F the
# pass moves the ones that wait to the host, draws the copy lane and prints both peaks per rank.
run schedule 1f1b -p 4 -m 8 --copy-times 0.25,0.25 --offload
check_rc "schedule --offload exits 0" 0
check_grep "--offload draws a copy lane" "$T/out" " copy |"
check_grep "--offload reports the peaks" "$T/err" "device peak / host peak: 0: 2 /"
expect_error "--offload without copy times" 2 "--copy-times" schedule 1f1b -p 4 -m 8 --offload
# A cost file's time_offload/time_reload stand in for --copy-times.
printf '%s' '{"format": "zbpp-costs", "version": 1, "ranks": 4, "chunks": 1, "placement": "loop",
  "time_f": [1,1,1,1], "time_b": [1,1,1,1], "time_w": [1,1,1,1],
  "time_offload": [0.25,0.25,0.25,0.25], "time_reload": [0.25,0.25,0.25,0.25]}' >"$T/copies.json"
run schedule 1f1b -p 4 -m 8 --stage-times "$T/copies.json" --offload
check_rc "schedule --offload with a cost file's copy times exits 0" 0
check_grep "--offload with a cost file's copy times moves microbatches" "$T/err" "device peak / host peak: 0: 2 /"
run schedule 1f1b -p 4 -m 8 --copy-times 0.25,0.25 --offload-paired
check_rc "--offload-paired exits 0" 0
check_grep "--offload-paired moves fewer (8 where own lanes move 15)" "$T/err" "offload: 8 microbatch"
run schedule zb-auto -p 8 -m 16 --mem-limit 3 --copy-times 0.5,0.5 --offload
check_rc "zb-auto --offload exits 0" 0
check_grep "zb-auto --offload plans order and copies together (cost 77, without copies 107)" "$T/out" "cost 77 "
printf '%s' '{"format": "zbpp-costs", "version": 1, "time_f": [1,1], "time_b": [1,1], "time_w": [1,1],
  "time_offload": [0.25,0.25]}' >"$T/halfcopies.json"
expect_error "a cost file with time_offload alone" 1 "go together" schedule 1f1b -p 2 -m 4 --stage-times "$T/halfcopies.json"
run schedule 1f1b -p 4 -m 8 --copy-times 50,50 --offload
check_rc "schedule --offload with copies too slow exits 0" 0
check_grep "--offload with copies too slow says nothing fits" "$T/err" "no copy fits"
# On 2 ranks 1F1B's peak (2 on rank 0) is reached while both microbatches are needed: fast copies
# hide but lower nothing, and the message says that is the other reason.
run schedule 1f1b -p 2 -m 8 --copy-times 0.02,0.02 --offload
check_grep "--offload where copies lower no peak says why" "$T/err" "lowers a rank's device peak"
expect_error "--copy-times with one value" 2 "OFFLOAD,RELOAD" schedule 1f1b -p 2 -m 2 --copy-times 1
expect_error "--offload-limit 0" 2 "--offload-limit" schedule 1f1b -p 2 -m 2 --offload-limit 0
# Vocabulary Parallelism: every rank runs the passes; the reference's extra warm-up forward gives
# 1F1B's p plus one (5 at p = 4), or plus two with two barriers.
run schedule 1f1b -p 4 -m 8 --vocab 2 --vocab-times 0.5,0.5,0.1,0.1,0.05
check_rc "schedule --vocab 2 exits 0" 0
check_grep "--vocab draws the passes" "$T/out" "vocabulary passes: S output layer forward"
check_grep "--vocab 2 holds p + 1" "$T/out" "peak memory 5 "
run schedule 1f1b -p 4 -m 8 --vocab 1
check_grep "--vocab 1 holds p + 2" "$T/out" "peak memory 6 "
expect_error "--vocab 3" 2 "Vocab-2" schedule 1f1b -p 2 -m 4 --vocab 3
expect_error "--vocab-times with four values" 2 "S,T,IF,IB,C" schedule 1f1b -p 2 -m 4 --vocab 2 --vocab-times 1,1,1,1
run schedule zb-v -p 4 -m 8 --vocab 2 --vocab-times 0.5,0.5,0.1,0.1,0.05
check_rc "schedule zb-v --vocab 2 exits 0 (the passes placed by simulation)" 0
check_grep "zb-v --vocab draws the passes" "$T/out" "vocabulary passes: S output layer forward"

run bench --help
check_rc "bench --help exits 0" 0
check_grep "bench --help lists --kinds" "$T/out" "--kinds"
run bench -p 2 -m 4 --steps 2 --width 8 --rows 4 --layers 1 --kinds 1f1b,zb-v
check_rc "a tiny bench exits 0" 0
check_grep "bench checks before timing" "$T/out" "bitwise"
check_grep "bench reports the runner's overhead" "$T/out" "us per op"
expect_error "bench with a bad option" 2 "--bogus" bench --bogus
expect_error "bench --kinds bogus" 2 "bogus" bench -p 2 -m 4 --steps 1 --kinds bogus
check_grep "bench --kinds bogus: message lists the kinds" "$T/err" "zb-v"
expect_error "bench --kinds with one bad item" 2 "zb-x" bench -p 2 -m 4 --steps 1 --kinds 1f1b,zb-x

# ---- summary -----------------------------------------------------------------------------------

echo "$PASSED passed, $FAILED failed"
if [ "$FAILED" -eq 0 ]; then exit 0; else exit 1; fi
