"""`python -m fuzz --steps N`: the differential fuzzer's long run (`fuzz/differential.py`; `--help` for the rest)."""

import sys

from fuzz.differential import main

sys.exit(main())
