"""Entry point for Ray job submission on an existing cluster:

    ray job submit --working-dir . -- python -m deploy.job --config deploy/configs/gpu-disaggregated.yaml

Joins the cluster the job runs on (address "auto"), starts the router and the pools, and serves until the job is
stopped (SIGTERM from `ray job stop`), then drains and removes its actors, leaving the cluster itself running.
"""

from __future__ import annotations

import sys

from deploy.serve import main

if __name__ == "__main__":
    sys.exit(main(join_cluster=True))
