"""TLS for the control plane's gRPC listeners: the files a ``ServerTls`` names become gRPC server credentials when a
server starts (validation does no I/O: a file that cannot be read is a ``ConfigError`` here, with its dotted path)."""

from __future__ import annotations

from pathlib import Path

import grpc

from controlplane.config import ConfigError, ServerTls


def _read(path: str, field: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError([f"{field}: cannot read {path}: {exc}"]) from None


def server_credentials(tls: ServerTls, section: str) -> grpc.ServerCredentials:
    """Credentials for a listener configured by ``section`` (``controlplane.tls``, ``admin.tls``). With
    ``client_ca_file``: mutual TLS, a client must present a certificate that CA signed (the handshake fails otherwise,
    before any RPC)."""
    pair = (_read(tls.key_file, f"{section}.key_file"), _read(tls.cert_file, f"{section}.cert_file"))
    if tls.client_ca_file is None:
        return grpc.ssl_server_credentials([pair])
    return grpc.ssl_server_credentials([pair], root_certificates=_read(tls.client_ca_file, f"{section}.client_ca_file"),
                                       require_client_auth=True)
