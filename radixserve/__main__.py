"""`python -m radixserve ...`: the `radixserve` command (radixserve.cli)."""

import sys

from radixserve.cli import main

sys.exit(main())
