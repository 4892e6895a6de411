"""kvmesh runtime library shared by every daemon (never imports a daemon)."""

from pkgutil import extend_path

# Generated stubs (kvmesh.v1.*) may live in another root, e.g. Bazel's bazel-bin/protos.
__path__ = extend_path(__path__, __name__)
