"""Entry point for `ray job submit --working-dir . -- python jobs/tune.py jobs/configs/NAME.yaml [k=v ...] [--resume]`.

A resubmitted job with --resume continues the sweep: finished trials stay, interrupted ones resume training.
"""

import sys

from sbert_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["tune", *sys.argv[1:]]))
