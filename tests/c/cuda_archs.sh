#!/bin/sh
# The library carries device code for every architecture CMake was asked for (by default sm_80,
# sm_86, sm_89, sm_90 and sm_100) and PTX for the newest, so it runs on every NVIDIA generation from
# A100 on ("no kernel image is available" otherwise), and it carries no CUDA runtime of its own (it
# uses the one torch loaded, libcudart.so.13 or .12, found at run time). Usage:
#   cuda_archs.sh CUOBJDUMP LIBRARY "ARCH ARCH ..." FATBIN...   (ARCH as in CMAKE_CUDA_ARCHITECTURES)
# The fatbins are the device code the library embeds (one per kernels/*.cu).
set -eu
cuobjdump=$1 lib=$2 archs=$3
shift 3
status=0
[ $# -gt 0 ] || { echo "no fatbins given"; exit 1; }
for fb in "$@"; do
  elf=$("$cuobjdump" --list-elf "$fb" 2>&1) || { echo "cuobjdump --list-elf $fb failed: $elf"; exit 1; }
  ptx=$("$cuobjdump" --list-ptx "$fb" 2>&1) || { echo "cuobjdump --list-ptx $fb failed: $ptx"; exit 1; }
  for a in $archs; do
    num=${a%%-*}
    case $a in
      *-virtual) ;;
      *) echo "$elf" | grep -q "sm_$num" || { echo "no sm_$num code in $fb"; status=1; } ;;
    esac
    case $a in
      *-real) ;;
      *) echo "$ptx" | grep -q "sm_$num\|compute_$num" || { echo "no PTX for compute_$num in $fb"; status=1; } ;;
    esac
  done
  # The library holds this fatbin's bytes (embedded by cmake/embed.cmake).
  name=$(basename "$fb" .fatbin)
  nm "$lib" | grep -q "zb__fatbin_${name}\$" || { echo "$lib does not embed $fb"; status=1; }
done
# No CUDA runtime inside or linked: no fatbin registration or runtime launch, no cudart dependency.
if nm "$lib" | grep -q " [TtDdBb] \(__cudaRegisterFatBinary\|cudaLaunchKernel\|cudaMalloc\)\$"; then
  echo "$lib carries a CUDA runtime (static cudart)"; status=1
fi
if readelf -d "$lib" | grep -q "NEEDED.*\(cudart\|libcuda\|cublas\|nccl\)"; then
  echo "$lib is linked to a CUDA library: $(readelf -d "$lib" | grep NEEDED)"; status=1
fi
[ $status -eq 0 ] && echo "device code for: $archs in $#; no CUDA runtime inside"
exit $status
