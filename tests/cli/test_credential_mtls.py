"""`credproxy credential add --scheme mtls`: the chain and key from stdin, checked; what is
shown is the certificate's (subject, issuer, SANs, expiry), never the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trustme

from tests.clihelp import Call, Cli


@pytest.fixture(scope="module")
def cli(tmp_path_factory: pytest.TempPathFactory) -> Cli:
    found = Cli(tmp_path_factory.mktemp("mtls-cli"))
    found.ok(Call(("init",)))
    return found


@pytest.fixture(scope="module")
def leaf() -> trustme.LeafCert:
    return trustme.CA().issue_cert("agent.clients.test", common_name="agent")


def _key_lines(leaf: trustme.LeafCert) -> list[bytes]:
    return [line for line in leaf.private_key_pem.bytes().splitlines() if b"-----" not in line]


def test_add_shows_the_certificate_and_list_its_expiry(cli: Cli, leaf: trustme.LeafCert) -> None:
    pem = leaf.private_key_and_cert_chain_pem.bytes()
    add = ("credential", "add", "cc", "--scheme", "mtls", "--host", "a.test")
    (added,) = cli.ok(Call(add, pem))
    assert added.startswith("added credential cc (mtls, fp-")
    assert "  subject: CN=agent" in added
    assert "  issuer: " in added
    assert "  sans: DNS:agent.clients.test" in added
    assert "  expires: 3000-01-01T00:00:00+00:00" in added
    listed, as_json = cli.ok(Call(("credential", "list")), Call(("credential", "list", "--json")))
    assert "expires" in listed.splitlines()[0]
    assert "3000-01-01T00:00:00+00:00" in listed
    [row] = [r for r in json.loads(as_json) if r["name"] == "cc"]
    assert row["expires"] == "3000-01-01T00:00:00+00:00"
    assert row["subject"].startswith("CN=agent,")


def test_a_key_that_is_not_the_certificates_is_one_line_and_status_2(
    cli: Cli, leaf: trustme.LeafCert
) -> None:
    other = trustme.CA().issue_cert("other.test")
    pem = leaf.cert_chain_pems[0].bytes() + other.private_key_pem.bytes()
    done = cli.run(Call(("credential", "add", "bad", "--scheme", "mtls", "--host", "a.test"), pem))
    assert done.returncode == 2
    assert done.stderr == "credproxy: error: the private key does not match any certificate\n"
    assert done.stdout == ""


def test_a_pkcs12_is_read_with_its_passphrase_from_stdin(cli: Cli) -> None:
    from tests.store.rules.test_clientcert import _p12

    leaf = trustme.CA().issue_cert("p12.clients.test", common_name="p12")
    stdin = b"s3cret-pass\n" + _p12(leaf, b"s3cret-pass")
    add = ("credential", "add", "p12", "--scheme", "mtls", "--host", "a.test", "--pkcs12")
    (added,) = cli.ok(Call(add, stdin))
    assert "  subject: CN=p12," in added
    wrong = cli.run(Call(("credential", "rotate", "p12", "--pkcs12"), b"nope\n" + stdin[12:]))
    assert (wrong.returncode, wrong.stderr) == (
        2,
        "credproxy: error: the PKCS#12 does not open: not PKCS#12, or a wrong passphrase\n",
    )
    bearer = ("credential", "add", "b", "--scheme", "bearer", "--host", "a.test", "--pkcs12")
    refused = cli.run(Call(bearer, stdin))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert b"s3cret-pass" not in b"".join(cli.outputs)


def test_the_key_is_in_no_output_nor_in_the_database(cli: Cli, leaf: trustme.LeafCert) -> None:
    """Last: every output of the commands above, and the database file."""
    outputs = b"".join(cli.outputs)
    database = Path(cli.db_file).read_bytes()
    assert outputs
    for line in _key_lines(leaf):
        assert line not in outputs
        assert line not in database
