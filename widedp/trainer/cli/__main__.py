"""`python -m widedp.trainer.cli ARGS`: the `widedp` command."""

import sys

from widedp.trainer.cli import main

sys.exit(main())
