"""``python -m diloco.worker --run-dir DIR --group G --rank R``: one worker of a local job's group."""

import sys

from diloco.worker.entry import main

sys.exit(main())
