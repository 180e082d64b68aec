"""``python -m diloco.ft --run-dir DIR``: the lighthouse of the job described by DIR/job.json.

The embedded launcher runs the lighthouse this way, as its own process, so that it can be
killed and restarted like any other part of the job.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from diloco.config import job_config_from_dict
from diloco.ft.lighthouse import serve_forever


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--signature", default=None, help="model signature every group must present")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    job = job_config_from_dict(json.loads((args.run_dir / "job.json").read_text()))
    serve_forever(job.cluster.lighthouse, job.cluster.quorum_rules(), job.name, args.signature)


if __name__ == "__main__":
    main()
