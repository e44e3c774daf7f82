"""``python -m lora_suite``: the command line (``lora_suite.cli``)."""

import sys

from lora_suite.cli import main

sys.exit(main())
