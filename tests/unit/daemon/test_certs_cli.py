"""``patchswarm certs``: what it writes verifies against its CA with exactly the names asked for; every
bad argument gives one line and writes nothing; nothing is ever overwritten."""

from __future__ import annotations

import ipaddress
import os
import stat
import tempfile
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from patchswarm.daemon.cli import main


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse: a bad argument
        rc = int(e.code or 0)
    return rc, capsys.readouterr().err


@pytest.fixture(scope="module")
def ca_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("certs") / "ca"
    assert main(["certs", "ca", "--out", str(d)]) == 0
    return d


def test_ca_and_issue_write_what_verifies(ca_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert stat.S_IMODE(os.stat(ca_dir / "ca.key").st_mode) == 0o600
    rc, err = run(
        ["certs", "issue", "--ca", str(ca_dir), "--name", "host-1", "--ip", "10.0.0.7", "--ip", "::1"]
        + ["--dns", "Host-1.Example.", "--days", "30", "--out", str(tmp_path)],
        capsys,
    )
    assert (rc, err) == (0, "")
    assert stat.S_IMODE(os.stat(tmp_path / "host-1.key").st_mode) == 0o600
    ca = x509.load_pem_x509_certificate((ca_dir / "ca.pem").read_bytes())
    cert = x509.load_pem_x509_certificate((tmp_path / "host-1.pem").read_bytes())
    cert.verify_directly_issued_by(ca)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["host-1.example"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.7"), ipaddress.ip_address("::1")]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert 29 < (cert.not_valid_after_utc - cert.not_valid_before_utc).days <= 30


def test_nothing_is_overwritten(ca_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["certs", "issue", "--ca", str(ca_dir), "--name", "h", "--out", str(tmp_path)]
    assert run(args, capsys)[0] == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    (tmp_path / "h.key").unlink()  # the certificate alone is still there: nothing written either
    after_unlink = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    rc, err = run(args, capsys)
    assert rc == 1 and "h.pem exists: refusing to overwrite" in err and err.count("\n") == 1
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == after_unlink
    rc, err = run(["certs", "ca", "--out", str(ca_dir)], capsys)
    assert rc == 1 and "refusing to overwrite" in err and err.count("\n") == 1
    assert before["h.pem"] == (tmp_path / "h.pem").read_bytes()


def test_bad_ca_directories_give_one_line(ca_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "ca.pem").write_bytes((ca_dir / "ca.pem").read_bytes())
    (fake / "ca.key").write_bytes(b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
    other = tmp_path / "other"
    assert main(["certs", "ca", "--out", str(other)]) == 0
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "ca.pem").write_bytes((ca_dir / "ca.pem").read_bytes())
    (mixed / "ca.key").write_bytes((other / "ca.key").read_bytes())
    for where, expect in [(tmp_path / "none", "no such file"), (fake, "not an unencrypted"), (mixed, "not the key")]:
        rc, err = run(["certs", "issue", "--ca", str(where), "--name", "h", "--out", str(tmp_path / "o")], capsys)
        assert rc == 1 and expect in err and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


_TEXT = st.text(st.characters(codec="utf-8", exclude_characters="\0"), max_size=40)
_ARG = st.one_of(
    _TEXT,
    st.sampled_from(["", "-", "..", "a/b", "-1", "0", "3651", "1e3", "999999999999999999999", "256.1.1.1", "::g"]),
    st.integers(-5, 4000).map(str),
    st.ip_addresses().map(str),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=_ARG, ip=_ARG, dns=_ARG, days=_ARG)
def test_hostile_arguments_one_line_and_nothing_partial(
    ca_dir: Path, capsys: pytest.CaptureFixture[str], name: str, ip: str, dns: str, days: str
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        argv = ["certs", "issue", "--ca", str(ca_dir), "--name", name, "--ip", ip, "--dns", dns]
        rc, err = run([*argv, "--days", days, "--out", str(out)], capsys)
        if rc == 0:
            cert = x509.load_pem_x509_certificate((out / f"{name}.pem").read_bytes())
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            addr = ipaddress.ip_address(ip)
            mapped = addr.ipv4_mapped if isinstance(addr, ipaddress.IPv6Address) else None
            assert san.get_values_for_type(x509.IPAddress) == [mapped or addr]
            assert san.get_values_for_type(x509.DNSName) == [dns.removesuffix(".").lower()]
            assert 1 <= int(days) <= 3650
            assert sorted(p.name for p in out.iterdir()) == [f"{name}.key", f"{name}.pem"]
        else:
            assert rc in (1, 2) and err.count("\n") == 1 and "Traceback" not in err, err
            assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["--dns", "10.0.0.7"], "argument --dns: 10.0.0.7 is an IP address: give it with --ip"),
        (["--ip", "fe80::1%eth0"], "argument --ip: a scoped address (fe80::1%eth0) cannot be named in a certificate"),
        (["--name", "ca"], "argument --name: 'ca' would be taken for the CA's own files (ca.pem, ca.key)"),
        (["--name", "CA"], "argument --name: 'CA' would be taken for the CA's own files (ca.pem, ca.key)"),
    ],
)
def test_names_that_would_not_do_what_they_say_are_refused(
    ca_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], expect: str
) -> None:
    # A DNS SAN holding an address never matches that address; a certificate cannot hold an IPv6 scope
    # (it would be dropped silently); a host named "ca" writes ca.pem/ca.key, which `issue --ca` then
    # takes for a CA.
    argv = ["certs", "issue", "--ca", str(ca_dir), "--name", "h", *args, "--out", str(tmp_path / "out")]
    rc, err = run(argv, capsys)
    assert rc == 2 and err.count("\n") == 1 and expect in err, err
    assert not (tmp_path / "out").exists()


def test_an_ipv4_mapped_address_is_written_as_ipv4(
    ca_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # (a peer reached at 10.0.0.7 is matched against an IPv4 SAN; ::ffff:10.0.0.7 would be a 16-byte one)
    rc, err = run(
        ["certs", "issue", "--ca", str(ca_dir), "--name", "h", "--ip", "::ffff:10.0.0.7", "--out", str(tmp_path)],
        capsys,
    )
    assert (rc, err) == (0, "")
    cert = x509.load_pem_x509_certificate((tmp_path / "h.pem").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.7")]
