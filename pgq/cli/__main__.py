"""`python -m pgq.cli`: the same as the `pgq` command."""

from __future__ import annotations

from pgq.cli import main

if __name__ == "__main__":
    main()
