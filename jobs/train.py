"""Entry point for `ray job submit --working-dir . -- python jobs/train.py jobs/configs/NAME.yaml [key=value ...]`."""

import sys

from sbert_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
