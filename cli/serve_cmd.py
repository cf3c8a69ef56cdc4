"""``pdserve serve``: the cluster's own ``serve`` (cluster/run/serve.py), given the planner's autoscaling model.

Why here: ``autoscale.profile`` is read by the planner (planner/autoscale_model.py), which the cluster layer may not
import; the CLI sits above both and hands the cluster a function that builds the model from the final config.
"""

from __future__ import annotations

import argparse


def run(args: argparse.Namespace) -> int:
    from cluster.run.serve import serve
    from planner.autoscale_model import capacity_model_for

    return serve(args, capacity_model=capacity_model_for)
