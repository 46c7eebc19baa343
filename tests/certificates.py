"""Self-signed server certificates for the TLS tests, made with ``cryptography``.

A test makes a key and certificates for it (for 127.0.0.1, ::1 and localhost): a renewal is a
new certificate for the same key (the same pin), a changed key a new ``ServerIdentity`` from
another key. EC P-256 keys: made in a millisecond, and every TLS stack here takes them.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from agent.tls import pin_of_pem


@dataclass(frozen=True)
class ServerIdentity:
    """A certificate and its key on disk, as uvicorn's --ssl-certfile/--ssl-keyfile take them."""

    cert_path: Path
    key_path: Path
    key: ec.EllipticCurvePrivateKey

    @property
    def pem(self) -> str:
        return self.cert_path.read_text()

    @property
    def pin(self) -> str:
        return pin_of_pem(self.pem)


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def server_identity(
    folder: Path, name: str, key: ec.EllipticCurvePrivateKey | None = None, *, common_name: str = "odmoe test"
) -> ServerIdentity:
    """A self-signed certificate for ``key`` (a new key if None) written to ``folder/name.{crt,key}``."""
    key = key or new_key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    names.append(x509.IPAddress(ipaddress.ip_address("::1")))
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    folder.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = folder / f"{name}.crt", folder / f"{name}.key"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return ServerIdentity(cert_path, key_path, key)
