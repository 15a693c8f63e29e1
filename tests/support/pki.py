"""Certificates for TLS tests, made with ``trustme``: a CA, server and client certificates.

``trustme`` names DNS, IP and e-mail identities; a URI identity (a SPIFFE ID) is
signed here with ``cryptography`` by the same trustme CA, from its public PEMs.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path

import trustme
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID

__all__ = ["Pki", "make_pki", "write_leaf", "write_uri_leaf", "swap_secret"]


@dataclass(frozen=True)
class Pki:
    """A CA file and a server certificate and key for ``localhost`` and ``127.0.0.1``."""

    ca: trustme.CA
    ca_file: str
    cert_file: str
    key_file: str


def make_pki(directory: Path) -> Pki:
    ca = trustme.CA()
    cert_file, key_file = write_leaf(ca, directory, "server", "localhost", "127.0.0.1")
    ca_file = str(directory / "ca.pem")
    ca.cert_pem.write_to_path(ca_file)
    return Pki(ca, ca_file, cert_file, key_file)


def write_leaf(ca: trustme.CA, directory: Path, stem: str, *names: str) -> tuple[str, str]:
    """A certificate for ``names`` signed by ``ca``: ``(cert_file, key_file)``."""
    leaf = ca.issue_cert(*names)
    cert_file, key_file = str(directory / f"{stem}.pem"), str(directory / f"{stem}.key")
    for index, blob in enumerate(leaf.cert_chain_pems):
        blob.write_to_path(cert_file, append=index > 0)
    leaf.private_key_pem.write_to_path(key_file)
    return cert_file, key_file


def write_uri_leaf(ca: trustme.CA, directory: Path, stem: str, uri: str) -> tuple[str, str]:
    """A client certificate whose only identity is the URI SAN ``uri``, signed by ``ca``."""
    issuer = x509.load_pem_x509_certificate(ca.cert_pem.bytes())
    issuer_key = serialization.load_pem_private_key(ca.private_key_pem.bytes(), password=None)
    assert isinstance(issuer_key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey), issuer_key
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([]))
        .issuer_name(issuer.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri)]), critical=True
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(issuer_key, hashes.SHA256())
    )
    cert_file, key_file = str(directory / f"{stem}.pem"), str(directory / f"{stem}.key")
    Path(cert_file).write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    Path(key_file).write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


def swap_secret(volume: Path, files: dict[str, bytes], generation: int) -> None:
    """Write ``files`` into ``volume`` the way Kubernetes updates a secret volume.

    Each file is ``volume/<name>`` -> ``..data/<name>``; ``..data`` is a symlink to
    a directory per generation, replaced by renaming a new symlink over it, so a
    reader sees the old set or the new one, never a mix.
    """
    generation_dir = volume / f"..{generation}"
    generation_dir.mkdir()
    for name, content in files.items():
        (generation_dir / name).write_bytes(content)
    staged = volume / "..data_tmp"
    staged.symlink_to(generation_dir.name)
    os.replace(staged, volume / "..data")
    for name in files:
        link = volume / name
        if not link.is_symlink():
            link.symlink_to(Path("..data") / name)
