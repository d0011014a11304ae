"""Throwaway certificates for tests of TLS connections: :class:`Authority`.

A private certificate authority (an EC P-256 key, valid for a day) that issues server and
client certificates into a directory, as PEM files that etcd, PostgreSQL, ``ssl`` and grpcio
read. Needs the ``cryptography`` package (a development dependency of fenced, not an extra). ::

    ca = Authority(tmp_path)                        # tmp_path/ca.pem (+ ca.key)
    server = ca.issue("server", hosts=["127.0.0.1", "localhost"])
    client = ca.issue("client-fenced", common_name="fenced", client=True)
    server.cert, server.key                         # Paths of PEM files (the key mode 0600)
    ca.issue("old", hosts=["127.0.0.1"], expired=True)   # valid until yesterday

Failure behaviour: without ``cryptography`` importing this module raises ``ModuleNotFoundError``.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["Authority", "Issued"]


@dataclass(frozen=True)
class Issued:
    """The PEM files of one issued certificate and its private key."""

    cert: Path
    key: Path


class Authority:
    """A certificate authority whose files live in ``directory`` (see the module docstring).

    ``name`` names the authority's files (``NAME.pem``, ``NAME.key``): two authorities in one
    directory are two unrelated CAs (a "wrong CA" test)."""

    def __init__(self, directory: Path, name: str = "ca") -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"fenced test {name}")])
        now = datetime.datetime.now(datetime.UTC)
        self._subject = subject
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=2))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )
        self.cert = self.directory / f"{name}.pem"
        self.cert.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))
        self.key = self._write_key(self.directory / f"{name}.key", self._key)

    @staticmethod
    def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> Path:
        data = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        return path

    def issue(
        self,
        filename: str,
        *,
        hosts: list[str] | tuple[str, ...] = (),
        common_name: str | None = None,
        client: bool = False,
        server: bool | None = None,
        expired: bool = False,
    ) -> Issued:
        """A certificate signed by this authority: ``FILENAME.pem`` and ``FILENAME.key``.

        ``hosts``: subject alternative names (IP addresses or DNS names) a server is checked
        against. ``common_name``: the subject's CN (default: the first host, or ``filename``;
        ``""``: an empty subject); etcd takes a client certificate's CN as the user name, and its
        JSON gateway refuses client certificates that have one. ``client``/``server``: the
        extended key usages (``server`` defaults to True when ``hosts`` are given; etcd wants
        both on a member's certificate, which it also uses to dial its peers). ``expired``:
        valid from three days ago until yesterday.
        """
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        start, end = now - datetime.timedelta(days=1), now + datetime.timedelta(days=1)
        if expired:
            start, end = now - datetime.timedelta(days=3), now - datetime.timedelta(days=1)
        cn = common_name if common_name is not None else (hosts[0] if hosts else filename)
        names: list[x509.GeneralName] = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        usages: list[x509.ObjectIdentifier] = []
        if server if server is not None else bool(hosts):
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        if client:
            usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)] if cn else []))
            .issuer_name(self._subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        )
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        if usages:
            builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        cert_path = self.directory / f"{filename}.pem"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return Issued(cert_path, self._write_key(self.directory / f"{filename}.key", key))
