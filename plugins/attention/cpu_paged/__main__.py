"""``python -m radixserve.plugins.attention.cpu_paged``: build the CPU decode kernel now."""

from radixserve.plugins.attention.cpu_paged.kernel import build_main

build_main()
