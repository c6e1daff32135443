"""``patchswarm certs``: a cluster CA and host certificates for mutual TLS, for operators who have none.

``certs ca --out DIR`` writes DIR/ca.pem and DIR/ca.key (EC P-256, the key 0600); ``certs issue --ca DIR
--name HOST [--ip A] [--dns N] --days D --out DIR`` writes DIR/HOST.pem and DIR/HOST.key, a certificate
for both roles (serverAuth and clientAuth: every host serves peers and fetches from them) with the given
addresses and names as subject alternative names.  Nothing is ever overwritten: a file that exists stops
the command before anything is written, and each file appears whole (written aside, then linked in).
The policy these certificates serve is in swarm/tls.py and docs/security.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from patchswarm.daemon import cli_args
from patchswarm.daemon.user_error import UserError

MAX_DAYS = 3650  # ten years: past that, rotation has been forgotten, not planned
MAX_SANS = 64
MAX_PEM_BYTES = 64 << 10
CA_CERT, CA_KEY = "ca.pem", "ca.key"
_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,62})")
_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def host_name(text: str) -> str:
    """--name: the certificate's common name and its files' stem (NAME.pem, NAME.key)."""
    if not _NAME.fullmatch(text) or text.endswith("."):
        raise argparse.ArgumentTypeError(f"expected 1-63 letters, digits and . _ - (not first), got {text[:80]!r}")
    if f"{text.lower()}.pem" == CA_CERT:  # (`issue --ca DIR` would take DIR/ca.pem for the CA)
        raise argparse.ArgumentTypeError(f"{text!r} would be taken for the CA's own files ({CA_CERT}, {CA_KEY})")
    return text


def ip(text: str) -> str:
    try:
        addr = ipaddress.ip_address(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an IP address: {text[:80]!r}") from None
    if isinstance(addr, ipaddress.IPv6Address) and addr.scope_id:  # (a SAN holds 16 bytes: the scope would go)
        raise argparse.ArgumentTypeError(f"a scoped address ({text[:80]}) cannot be named in a certificate")
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:  # (peers reach it as IPv4)
        return str(addr.ipv4_mapped)
    return str(addr)


def dns(text: str) -> str:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        pass
    else:  # (a DNS name entry never matches an address: TLS checks addresses against IP entries)
        raise argparse.ArgumentTypeError(f"{text[:80]} is an IP address: give it with --ip")
    name = text.removesuffix(".")
    if not name or len(name) > 253 or not all(_DNS_LABEL.fullmatch(p) for p in name.split(".")):
        raise argparse.ArgumentTypeError(f"not a DNS name: {text[:80]!r}")
    return name.lower()


days = cli_args.bounded(int, "a whole number of days", 1, MAX_DAYS)


def out_dir(text: str) -> str:
    if os.path.exists(cli_args.path(text)) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    return text


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path
    serial: int


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _key_pem(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    out: bytes = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return out


def _place(out: Path, files: dict[str, tuple[bytes, int]]) -> None:
    """Write each file whole under ``out`` (created 0700 if missing), refusing any that exists; on a
    failure nothing of this call stays behind."""
    for name in files:
        if os.path.lexists(out / name):
            raise UserError(f"{out / name} exists: refusing to overwrite it (move it away first)")
    try:
        out.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {out}: {e.strerror or e}") from None
    placed: list[Path] = []
    try:
        for name, (data, mode) in files.items():
            fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{name}.")
            try:
                with os.fdopen(fd, "wb") as f:
                    os.fchmod(f.fileno(), mode)
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.link(tmp, out / name)  # fails if the name appeared meanwhile: never overwrites
                placed.append(out / name)
            finally:
                os.unlink(tmp)
    except FileExistsError as e:
        for p in placed:
            p.unlink(missing_ok=True)
        raise UserError(f"{e.filename2 or e.filename} exists: refusing to overwrite it") from None
    except OSError as e:
        for p in placed:
            p.unlink(missing_ok=True)
        raise UserError(f"cannot write in {out}: {e.strerror or e}") from None


def make_ca(out: Path, *, name: str = "patchswarm cluster CA", days: int = MAX_DAYS) -> Issued:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))  # (clock skew between hosts)
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )  # keyCertSign, cRLSign
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    from cryptography.hazmat.primitives import serialization

    _place(out, {CA_KEY: (_key_pem(key), 0o600), CA_CERT: (cert.public_bytes(serialization.Encoding.PEM), 0o644)})
    return Issued(out / CA_CERT, out / CA_KEY, cert.serial_number)


def _load_ca(ca_dir: Path) -> tuple[Any, Any]:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from patchswarm.protocol.files import InputFileError, read_file

    try:
        cert_pem, key_pem = (read_file(ca_dir / n, MAX_PEM_BYTES) for n in (CA_CERT, CA_KEY))
    except InputFileError as e:
        raise UserError(f"--ca: {e}") from None
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError:
        raise UserError(f"--ca: {ca_dir / CA_CERT} is not a PEM certificate") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError):
        raise UserError(f"--ca: {ca_dir / CA_KEY} is not an unencrypted PEM private key") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise UserError(f"--ca: {ca_dir / CA_KEY} is not an EC key")
    try:
        ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        ca = False
    if not ca:
        raise UserError(f"--ca: {ca_dir / CA_CERT} is not a CA certificate")
    if cert.public_key() != key.public_key():
        raise UserError(f"--ca: {ca_dir / CA_KEY} is not the key of {ca_dir / CA_CERT}")
    return cert, key


def issue(
    ca_dir: Path,
    out: Path,
    name: str,
    *,
    ips: list[str] = [],  # noqa: B006 (never mutated)
    dns_names: list[str] = [],  # noqa: B006
    days: int = 90,
    not_before: dt.datetime | None = None,
    not_after: dt.datetime | None = None,
) -> Issued:
    """A host certificate signed by the CA in ``ca_dir`` (``not_before``/``not_after``: tests' expired ones)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_cert, ca_key = _load_ca(ca_dir)
    now = _now()
    start = not_before or now - dt.timedelta(minutes=5)
    end = not_after or now + dt.timedelta(days=days)
    if end > ca_cert.not_valid_after_utc:
        until = f"{ca_cert.not_valid_after_utc:%Y-%m-%d}"
        raise UserError(f"--days: the certificate would outlive the CA (valid until {until})")
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dict.fromkeys(dns_names)]
    sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in dict.fromkeys(ips)]
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, True, False, False, False, False), critical=True
        )  # digitalSignature, keyAgreement
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    _place(out, {f"{name}.key": (_key_pem(key), 0o600), f"{name}.pem": (cert_pem, 0o644)})
    return Issued(out / f"{name}.pem", out / f"{name}.key", cert.serial_number)


def cmd_certs(args: argparse.Namespace) -> int:
    if args.certs_command == "ca":
        made = make_ca(Path(args.out), days=args.days)
        print(f"wrote {made.cert} and {made.key} (keep the key offline; give hosts {made.cert} as tls.ca)")
        return 0
    if len(args.ip) + len(args.dns) > MAX_SANS:
        raise UserError(f"at most {MAX_SANS} --ip and --dns together")
    got = issue(Path(args.ca), Path(args.out), args.name, ips=args.ip, dns_names=args.dns, days=args.days)
    print(f"wrote {got.cert} and {got.key} (serial {got.serial:x})")
    return 0


def add_certs_parser(sub: Any) -> None:
    c = sub.add_parser("certs", help="create a cluster CA and host certificates for mutual TLS (docs/daemon.md)")
    cs = c.add_subparsers(dest="certs_command", required=True)
    ca = cs.add_parser("ca", help="create a cluster CA: DIR/ca.pem and DIR/ca.key (0600)")
    ca.add_argument("--out", type=out_dir, required=True, metavar="DIR")
    ca.add_argument("--days", type=days, default=MAX_DAYS, help=f"validity (default and at most {MAX_DAYS})")
    iss = cs.add_parser("issue", help="issue a host certificate: DIR/NAME.pem and DIR/NAME.key (0600)")
    iss.add_argument("--ca", type=out_dir, required=True, metavar="DIR", help="the directory `certs ca` wrote")
    iss.add_argument("--name", type=host_name, required=True, metavar="HOST")
    iss.add_argument("--ip", type=ip, action="append", default=[], metavar="ADDR", help="an address (repeat)")
    iss.add_argument("--dns", type=dns, action="append", default=[], metavar="NAME", help="a DNS name (repeat)")
    iss.add_argument("--days", type=days, default=90, help=f"validity (default 90, at most {MAX_DAYS})")
    iss.add_argument("--out", type=out_dir, required=True, metavar="DIR")
    c.set_defaults(func=cmd_certs)
