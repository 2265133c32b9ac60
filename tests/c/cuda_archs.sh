#!/bin/sh
# The built library carries device code for every architecture CMake was asked for (by default
# sm_80, sm_86, sm_89, sm_90 and sm_100) and PTX for the newest, so it runs on every NVIDIA
# generation from A100 on ("no kernel image is available" otherwise). Usage:
#   cuda_archs.sh CUOBJDUMP LIBRARY "ARCH ARCH ..."   (ARCH as in CMAKE_CUDA_ARCHITECTURES)
set -eu
cuobjdump=$1 lib=$2 archs=$3
elf=$("$cuobjdump" --list-elf "$lib" 2>&1) || { echo "cuobjdump --list-elf failed: $elf"; exit 1; }
ptx=$("$cuobjdump" --list-ptx "$lib" 2>&1) || { echo "cuobjdump --list-ptx failed: $ptx"; exit 1; }
status=0
for a in $archs; do
  num=${a%%-*}
  case $a in
    *-virtual) ;;
    *) echo "$elf" | grep -q "sm_$num" || { echo "no sm_$num code in $lib"; status=1; } ;;
  esac
  case $a in
    *-real) ;;
    *) echo "$ptx" | grep -q "sm_$num\|compute_$num" || { echo "no PTX for compute_$num in $lib"; status=1; } ;;
  esac
done
[ $status -eq 0 ] && echo "device code for: $archs"
exit $status
