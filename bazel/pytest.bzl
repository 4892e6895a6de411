"""pytest_test: one py_test per pytest file, run through bazel/pytest_main.py.

pytest itself (and every third-party package) comes from the interpreter on PATH (the project
venv); the repository's pytest settings come from /pyproject.toml.
"""

def pytest_test(name, srcs, deps = [], data = [], args = [], markers = "not e2e and not etcd", **kwargs):
    """A py_test that runs pytest on `srcs`.

    Args:
      name: target name.
      srcs: the test file(s).
      deps: py_library deps (e.g. //libs/kvmesh).
      data: runtime files (e.g. //protos:all_protos, conftest.py files).
      args: extra pytest arguments.
      markers: pytest -m expression; tests that need external services stay out of Bazel.
      **kwargs: passed to py_test (size, tags, ...).
    """
    native.py_test(
        name = name,
        srcs = srcs + ["//bazel:pytest_main.py"],
        main = "//bazel:pytest_main.py",
        deps = deps,
        data = data + ["//:pyproject.toml"],
        args = ["-c", "$(rootpath //:pyproject.toml)"] +
               (["-m", "'%s'" % markers] if markers else []) +
               args + ["$(rootpath %s)" % s for s in srcs],
        python_version = "PY3",
        srcs_version = "PY3",
        **kwargs
    )
