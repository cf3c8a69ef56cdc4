"""What every worker shares, below the prefill and decode roles: the run loop and its sockets (``runtime``), the
authenticated control protocol (``protocol``) and the colocated role (``colocated``). Imports engine and transfer
only; the cluster layer above builds workers from it."""
