# Writes a binary file as a C array: cmake -DIN=file -DOUT=file.c -DNAME=symbol -P embed.cmake
# gives `const unsigned char NAME[]` (8-byte aligned, as the CUDA driver wants a fatbin image) and
# `const size_t NAME_size`. Used for the device code's fatbins (csrc/cuda/launch.c loads them).
file(READ "${IN}" hex HEX)
string(LENGTH "${hex}" n)
math(EXPR bytes "${n} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," body "${hex}")
string(REGEX REPLACE "((0x[0-9a-f][0-9a-f],){32})" "\\1\n" body "${body}")
file(WRITE "${OUT}" "/* Generated from ${IN} by cmake/embed.cmake; do not edit. */\n#include <stddef.h>\n"
     "__attribute__((aligned(8))) const unsigned char ${NAME}[] = {\n${body}\n};\n"
     "const size_t ${NAME}_size = ${bytes};\n")
