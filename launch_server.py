"""``python -m radixserve.launch_server``: SGLang's spelling of ``radixserve serve``."""

from __future__ import annotations

if __name__ == "__main__":
    # Imported here, not at the top: the engine process (multiprocessing spawn) imports this
    # module again as its __main__, and the HTTP stack would cost it a second of start-up.
    from radixserve.entrypoints.launch_server import main
    from radixserve.entrypoints.process_exit import run_then_exit

    run_then_exit(main)
