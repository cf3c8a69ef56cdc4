"""``pdserve serve``: the cluster's ``serve`` (cluster/run/serve.py), given the planner's autoscaling model.

The cluster may not import the planner (planner/autoscale_model.py reads ``autoscale.profile``), so the CLI, above
both, hands it the function that builds the model from the final config.
"""

from __future__ import annotations

import argparse


def run(args: argparse.Namespace) -> int:
    from cluster.run.serve import serve
    from planner.autoscale_model import capacity_model_for

    return serve(args, capacity_model=capacity_model_for)
