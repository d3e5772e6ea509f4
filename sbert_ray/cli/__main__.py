"""``python -m sbert_ray.cli ...``, as the ``sbert-ray`` command."""

import sys

from sbert_ray.cli import main

sys.exit(main())
