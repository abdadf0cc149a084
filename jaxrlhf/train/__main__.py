"""``python -m jaxrlhf.train --config FILE [--config OVERLAY ...] [overrides]``: parse, load
the config (the files merged in order), run. The command line lives in
:mod:`jaxrlhf.train.cli`; ``python -m jaxrlhf.train --help`` lists every config field.

User errors (config, data, checkpoint, mesh, reward) print one line ``error: ...`` and exit 2.
"""

from __future__ import annotations

import sys

from jaxrlhf.train.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
