"""``python -m kvmesh_frontend`` is ``kvmesh-frontend``."""

import sys

from kvmesh_frontend.main import main

sys.exit(main())
