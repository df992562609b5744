"""Real X.509 certificates for the TLS tests, made with the `cryptography` package in a temp directory.

    pki = TestPKI(tmp_path)
    pki.ca_file                                      # the cluster CA (PEM)
    cert, key = pki.issue("router")                  # from the cluster CA, for localhost, 127.0.0.1 and
                                                     # tandem-worker, usable as server and as client
    cert, key = pki.issue("stranger", ca=pki.other)  # from another CA
    cert, key = pki.issue("old", expired=True)       # valid from 10 days ago until yesterday

EC P-256 keys: a certificate takes milliseconds to make.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_NAMES = ("localhost", "127.0.0.1", "tandem-worker")


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


@dataclass
class CA:
    name: str
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @classmethod
    def create(cls, name: str) -> CA:
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(_name(name))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=30))
            .not_valid_after(now + dt.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
            )
            .sign(key, hashes.SHA256())
        )
        return cls(name, key, cert)

    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)


class TestPKI:
    """A cluster CA and a stranger's CA in `root`; issue() writes a certificate and its key next to them."""

    __test__ = False  # not a test class, whatever pytest's name matching says

    def __init__(self, root: Path, name: str = "Tandem test cluster CA") -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.ca = CA.create(name)  # CAs with one name would be mistaken for one another when chains are built
        self.other = CA.create(f"Someone else's CA (not {name})")
        self.ca_file = self._write("ca.crt", self.ca.pem())
        self.other_ca_file = self._write("other-ca.crt", self.other.pem())

    def _write(self, name: str, data: bytes) -> str:
        path = self.root / name
        path.write_bytes(data)
        return str(path)

    def issue(
        self,
        name: str,
        *,
        ca: CA | None = None,
        names: tuple[str, ...] = DEFAULT_NAMES,
        expired: bool = False,
    ) -> tuple[str, str]:
        """(cert file, key file) of a certificate for `names`, good for TLS servers and clients alike."""
        ca = ca or self.ca
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        start, end = (
            (now - dt.timedelta(days=10), now - dt.timedelta(days=1))
            if expired
            else (
                now - dt.timedelta(hours=1),
                now + dt.timedelta(days=7),
            )
        )
        sans: list[x509.GeneralName] = []
        for n in names:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(n)))
            except ValueError:
                sans.append(x509.DNSName(n))
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(ca.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(ca.key, hashes.SHA256())
        )
        cert_file = self._write(f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM))
        return cert_file, self._write(f"{name}.key", _pem_key(key))
