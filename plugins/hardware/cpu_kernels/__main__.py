"""``python -m radixserve.plugins.hardware.cpu_kernels``: build the CPU kernels now."""

from radixserve.plugins.hardware.cpu_kernels import build_main

build_main()
