"""``kvmesh datagen``: analyze Mooncake traces and synthesize new ones with the same prefix structure.

Modules: :mod:`.prefix_tree` (core radix tree extraction), :mod:`.analyze` (statistics and comparison),
:mod:`.synthesize` (the sampler and its knobs), :mod:`.cli` (``register`` for the ``kvmesh`` CLI). This package
imports nothing itself, so registering the CLI does not load numpy or networkx.
"""
