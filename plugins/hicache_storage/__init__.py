"""HiCache storage backends (the third tier of ``--enable-hierarchical-cache``)."""
