"""``python -m radixserve.launch_server``: SGLang's spelling of ``radixserve serve``."""

from __future__ import annotations

import sys

from radixserve.entrypoints.launch_server import main

if __name__ == "__main__":
    sys.exit(main())
