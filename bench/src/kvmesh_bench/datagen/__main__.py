"""``python -m kvmesh_bench.datagen analyze|synthesize ...`` (the same as ``kvmesh datagen ...``)."""

import sys

from kvmesh_bench.datagen.cli import main

sys.exit(main(["datagen", *sys.argv[1:]]))
