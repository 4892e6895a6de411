"""``kvmesh-frontend``'s settings, declared once (flags, ``KVMESH_*`` and ``[frontend]`` derive from them)."""

from __future__ import annotations

from typing import Literal, Self

from kvmesh.settings import DaemonSettings, Port, Seconds
from pydantic import NonNegativeFloat, NonNegativeInt, PositiveInt, model_validator

from kvmesh_frontend.pipeline import DEFAULT_MAX_TOKENS


class Settings(DaemonSettings):
    """The common daemon settings plus the KServe server's."""

    grpc_port: Port = 8001
    """KServe v2 gRPC port (Triton's default; 0 picks a free one)"""
    kserve_client_cert: bool = False
    """with --tls-*: KServe clients must present a certificate from --tls-ca (mTLS, as Triton offers)"""
    kserve_token_file: str = ""
    """file holding a bearer token KServe clients must send as 'authorization: Bearer <token>' (use with TLS)"""
    migration_limit: NonNegativeInt = 3
    """times a request may move to another engine when its engine dies mid-stream (0 = off)"""
    route_timeout: Seconds = 30.0
    """seconds to wait for a router decision before answering UNAVAILABLE"""
    route_hedge: Seconds = 1.0
    """seconds without a router decision before the query is also sent to another replica (0 = never)"""
    default_max_tokens: PositiveInt = DEFAULT_MAX_TOKENS
    """max_tokens of requests that do not say"""
    model_fetch_timeout: Seconds = 30.0
    """seconds to download a model's tokenizer files from a worker"""
    admission_factor: NonNegativeFloat = 1.0
    """requests of a model in flight at this frontend beyond this many times its engines' capacity (sum of
    max_num_seqs + max_waiting_requests, from their cards) are refused RESOURCE_EXHAUSTED at once, before
    any work (0 = off; no bound either when an engine's waiting queue is unbounded)"""

    # -- disaggregated prefill/decode (docs/disaggregation.md) ----------------------------------------
    disagg_busy: Literal["local", "reject"] = "local"
    """when every prefill engine is over the router's busy thresholds: prefill on the decode engine
    (local) or answer RESOURCE_EXHAUSTED (reject)"""
    enforce_disagg: bool = False
    """with no prefill engine left, answer UNAVAILABLE instead of prefilling on the decode engine"""

    @model_validator(mode="after")
    def _client_cert_needs_tls(self) -> Self:
        if self.kserve_client_cert and not self.tls_enabled:
            raise ValueError(
                "--kserve-client-cert needs --tls-cert, --tls-key and --tls-ca (the CA clients' certificates come from)"
            )
        return self
