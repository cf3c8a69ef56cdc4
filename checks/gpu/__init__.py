"""``make gpu-check`` / ``gpu-check-quick`` (gpu_check.py and its sections) and ``make gpu-wheels`` (gpu_wheels.py)."""
