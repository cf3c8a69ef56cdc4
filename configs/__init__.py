"""The shipped configs (local.yaml, gpu-node.yaml, cluster.yaml), installed as package data so that
``pdserve serve --config local`` works from an installed wheel outside the source tree."""
