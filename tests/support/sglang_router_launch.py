"""Start sglang-router's own launcher (what ``python -m sglang_router.launch_router`` runs),
without importing its Python load balancer.

``sglang_router.launch_router`` imports ``sglang_router.mini_lb`` at module level, only for
``--mini-lb``; that module imports ``sglang`` and, through it, transformers and
``torch.distributed.tensor``: ~5 s of CPU before the Rust router starts (about 0.1 s). The PD
tests never pass ``--mini-lb``, so a stand-in takes the module's place; the arguments, their
parsing and the router that serves are the package's own.
"""

from __future__ import annotations

import sys
import types
from typing import NoReturn


class _NoMiniLoadBalancer:
    def __init__(self, *args: object, **kwargs: object) -> NoReturn:
        raise RuntimeError("--mini-lb needs the real sglang_router.mini_lb (python -m ...)")


def main() -> None:
    """Run the launcher's ``main`` on this process's arguments."""
    stand_in = types.ModuleType("sglang_router.mini_lb")
    stand_in.MiniLoadBalancer = _NoMiniLoadBalancer  # type: ignore[attr-defined]
    sys.modules["sglang_router.mini_lb"] = stand_in
    from sglang_router.launch_router import main as launch

    launch()


if __name__ == "__main__":
    main()
