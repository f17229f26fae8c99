"""``python -m lowcomm``: the same as the ``lowcomm`` command."""

from lowcomm.cli import main

# Spawned worker processes import this module as __mp_main__; only the real entry runs main().
if __name__ == "__main__":
    raise SystemExit(main())
