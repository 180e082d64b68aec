"""``python -m diloco.launch.lighthouse_process --run-dir DIR``: the lighthouse of the job described by DIR/job.json.

The embedded launcher runs the lighthouse this way, as its own process, so that it can be
killed and restarted like any other part of the job; ``--lifeline-fd`` ties it to the
launcher's life (diloco.lifeline). With ``cluster.spawn=fork`` the fork server runs
``run_lighthouse`` in a forked child instead, which skips the seconds of imports.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from diloco import lifeline
from diloco.config.job import job_config_from_dict, training_config
from diloco.ft.lighthouse import serve_forever
from diloco.process_logging import setup_process_logging
from diloco.run_paths import RunPaths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--signature", default=None, help="model signature every group must present")
    lifeline.add_argument(parser)
    args = parser.parse_args(argv)
    if args.lifeline_fd is not None:
        lifeline.watch(args.lifeline_fd)
    run_lighthouse(args.run_dir, args.signature)


def run_lighthouse(run_dir: Path, signature: str | None) -> None:
    """Serve the lighthouse of the job in ``run_dir`` until it ends or is stopped (SIGTERM, SIGINT).

    The one body of both ways to start it: ``python -m diloco.launch.lighthouse_process`` and a child of the fork server.
    """
    setup_process_logging()
    job = job_config_from_dict(json.loads((run_dir / "job.json").read_text()))
    serve_forever(
        job.cluster.lighthouse,
        job.cluster.quorum_rules(),
        job.name,
        signature,
        job_config=training_config(job),
        saved_page=RunPaths(run_dir).status_page,
    )


if __name__ == "__main__":
    main()
