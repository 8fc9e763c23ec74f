"""Small C kernels for the CPU path, built on first use with the system C
compiler (cc/gcc, -march=native) into the qoqserve cache and called through
ctypes. Where no compiler is available the torch path is used instead."""
