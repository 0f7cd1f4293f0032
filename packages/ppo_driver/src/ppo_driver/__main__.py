"""``python -m ppo_driver``: the same as the ``ppo-driver`` command."""

import sys

from ppo_driver.cli import main

sys.exit(main())
