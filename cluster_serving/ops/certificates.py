"""Certificates for this machine's own services: a private certificate authority and a server
certificate it signs, as PEM files. The secured local broker (`cluster-serving broker --secure`)
and a bridge tried over HTTPS use them; a deployment uses the certificates of its own CA.
Made with `cryptography` (pyca), the Python package made for the job, not by calling openssl."""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

VALID_DAYS = 825
LOCAL_NAMES = ("localhost", "127.0.0.1")


@dataclass(frozen=True)
class ServerCertificates:
    """PEM files: the authority's certificate (what clients trust), the server's certificate and its key."""

    ca: Path
    certificate: Path
    key: Path


def local_certificates(folder: Path, names: tuple[str, ...] = LOCAL_NAMES) -> ServerCertificates:
    """The certificates in `folder`, made there (key files owner-only) when they are not yet."""
    files = ServerCertificates(folder / "ca.pem", folder / "server.pem", folder / "server.key")
    if all(path.exists() for path in (files.ca, files.certificate, files.key)):
        return files
    folder.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate(_name("cluster-serving local CA"), ca_key, ca_key, _name("cluster-serving local CA"), authority=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    alternative = [
        x509.IPAddress(ipaddress.ip_address(name)) if _is_address(name) else x509.DNSName(name) for name in names
    ]
    server = (
        _builder(_name(names[0]), server_key, ca.subject)
        .add_extension(x509.SubjectAlternativeName(alternative), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    write_file(files.key, server_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()), private=True)
    write_file(files.certificate, server.public_bytes(serialization.Encoding.PEM))
    write_file(files.ca, ca.public_bytes(serialization.Encoding.PEM))
    return files


def _certificate(subject: x509.Name, key: ec.EllipticCurvePrivateKey, signer: ec.EllipticCurvePrivateKey,
                 issuer: x509.Name, authority: bool) -> x509.Certificate:
    return (
        _builder(subject, key, issuer)
        .add_extension(x509.BasicConstraints(ca=authority, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=authority, crl_sign=authority, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
            decipher_only=False), critical=True)
        .sign(signer, hashes.SHA256())
    )


def _builder(subject: x509.Name, key: ec.EllipticCurvePrivateKey, issuer: x509.Name) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def write_file(path: Path, data: bytes, private: bool = False) -> None:
    """Writes `data`; `private`: readable by its owner only, from its creation on."""
    mode = 0o600 if private else 0o644
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    os.fchmod(descriptor, mode)  # a file that was there keeps its mode through os.open
    with os.fdopen(descriptor, "wb") as file:
        file.write(data)
