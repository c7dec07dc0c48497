"""A policy file against the store: plan, apply in one transaction, prune, export round trip."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from store.crypto import MasterKey
from store.errors import Conflict, InvalidInput
from store.policyfile import reconcile
from store.policyfile.parse import PolicyFileError, load
from store.repository import Store
from tests.fakes import POLICY
from tests.stores import SECRET


@pytest.fixture
def policy_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], Path]:
    monkeypatch.setenv("GITHUB_TOKEN", "ghp_policy_secret_1")

    def write(text: str) -> Path:
        path = tmp_path / "policy.toml"
        path.write_text(text)
        return path

    return write


def _apply(store: Store, key: MasterKey, path: Path, **kw: object) -> reconcile.Applied:
    return reconcile.apply(store.db, key, load(path), **kw)  # type: ignore[arg-type]


def test_apply_creates_everything_then_a_second_apply_is_a_no_op(
    store: Store, key: MasterKey, policy_file: Callable[[str], Path]
) -> None:
    path = policy_file(POLICY)
    counter = store.change_counter()
    applied = _apply(store, key, path)
    assert [(c.kind, c.name, c.action) for c in applied.plan.changes] == [
        ("principal", "agent", "create"),
        ("credential", "github", "create"),
        ("grant", "triage-widgets", "create"),
    ]
    assert set(applied.tokens) == {"agent"}
    assert store.change_counter() == counter + 1  # the whole apply is one change
    (grant,) = store.list_grants()
    assert (grant.key, grant.principal, grant.credential) == ("triage-widgets", "agent", "github")
    snapshot = store.snapshot()
    assert snapshot.credentials["github"].secret.reveal() == b"ghp_policy_secret_1"

    assert reconcile.plan(store.db, key, load(path)).empty
    again = _apply(store, key, path)
    assert again.plan.empty and not again.tokens
    assert store.change_counter() == counter + 1  # a no-op moves nothing, not even the counter


def test_a_changed_grant_is_updated_in_place_and_keeps_its_id(
    store: Store, key: MasterKey, policy_file: Callable[[str], Path]
) -> None:
    _apply(store, key, policy_file(POLICY))
    (before,) = store.list_grants()
    changed = POLICY.replace('methods = ["GET"]', 'methods = ["GET", "POST"]')
    plan = reconcile.plan(store.db, key, load(policy_file(changed)))
    (change,) = plan.changes
    assert (change.kind, change.action, change.fields) == (
        "grant",
        "update",
        {"methods": (["GET"], ["GET", "POST"])},
    )
    _apply(store, key, policy_file(changed))
    (after,) = store.list_grants()
    assert (after.id, after.methods, after.state) == (before.id, ["GET", "POST"], "active")


def test_a_changed_secret_shows_only_as_fingerprints_and_is_resealed(
    store: Store,
    key: MasterKey,
    policy_file: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = policy_file(POLICY)
    _apply(store, key, path)
    monkeypatch.setenv("GITHUB_TOKEN", "ghp_policy_secret_2")
    (change,) = reconcile.plan(store.db, key, load(path)).changes
    assert change.fields.keys() == {"secret"}
    before, after = change.fields["secret"]
    assert str(before).startswith("fp-") and str(after).startswith("fp-")
    assert "ghp_policy_secret" not in change.describe() + repr(change.as_json())
    _apply(store, key, path)
    assert store.snapshot().credentials["github"].secret.reveal() == b"ghp_policy_secret_2"


def test_without_a_secret_source_an_existing_credential_keeps_its_secret(
    store: Store, key: MasterKey, policy_file: Callable[[str], Path]
) -> None:
    _apply(store, key, policy_file(POLICY))
    no_source = POLICY.replace('secret_env = "GITHUB_TOKEN"\n', "")
    assert reconcile.plan(store.db, key, load(policy_file(no_source))).empty


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        pytest.param(
            ('secret_env = "GITHUB_TOKEN"', 'secret_env = "CP_TEST_NEVER_SET"'),
            'policy.toml:8: credential "github": the variable secret_env names is not set',
            id="a missing secret source changes nothing and says where",
        ),
        pytest.param(
            ('principal = "agent"', 'principal = "ghost"'),
            "policy.toml:10: grant \"triage-widgets\": principal 'ghost' is not declared",
            id="a grant for an undeclared principal",
        ),
        pytest.param(
            ('hosts = ["api.github.com"]', 'hosts = ["api.github.com"]\nheader = "X-Key"'),
            'policy.toml:6: credential "github": header goes with scheme header',
            id="a scheme option the scheme does not take",
        ),
        pytest.param(
            ('paths = ["/repos/acme/widgets/issues"]', 'hosts = ["evil.example"]'),
            'policy.toml:10: grant "triage-widgets": host evil.example is outside credential',
            id="grant hosts outside the credential's",
        ),
    ],
)
def test_a_bad_file_changes_nothing(
    store: Store,
    key: MasterKey,
    policy_file: Callable[[str], Path],
    edit: tuple[str, str],
    message: str,
) -> None:
    counter = store.change_counter()
    path = policy_file(POLICY.replace(*edit))
    with pytest.raises(PolicyFileError) as raised:
        _apply(store, key, path)
    shown = [p.replace(str(path), "policy.toml") for p in raised.value.problems]
    assert any(p.startswith(message) for p in shown), shown
    assert store.change_counter() == counter
    assert store.list_principals() == [] and store.list_credentials() == []


def test_prune_revokes_what_the_file_no_longer_declares(
    store: Store, key: MasterKey, policy_file: Callable[[str], Path]
) -> None:
    _apply(store, key, policy_file(POLICY))
    store.add_principal("other")
    cli_grant = store.add_grant("agent", ["GET"], hosts=["example.com"])
    plan = reconcile.plan(store.db, key, load(policy_file(POLICY)))
    assert plan.empty
    assert set(plan.untouched) == {"principal other", f"grant grant-{cli_grant}"}

    smaller = POLICY.split("[[grant]]")[0]
    pruned = _apply(store, key, policy_file(smaller), prune=True)
    assert {(c.kind, c.name, c.action) for c in pruned.plan.changes} == {
        ("principal", "other", "remove"),
        ("grant", "triage-widgets", "revoke"),
        ("grant", f"grant-{cli_grant}", "revoke"),
    }
    assert [p.name for p in store.list_principals()] == ["agent"]
    assert {g.state for g in store.list_grants()} == {"revoked"}


def test_export_then_apply_is_a_no_op(
    store: Store, key: MasterKey, policy_file: Callable[[str], Path], tmp_path: Path
) -> None:
    _apply(store, key, policy_file(POLICY))
    store.add_credential("ex", "header", ["*.example.com"], SECRET, header_name="X-Api-Key")
    store.add_grant(
        "agent",
        ["POST", "GET"],
        credential="ex",
        hosts=["eu.example.com"],
        paths=["/v1/"],
        websocket=True,
        purpose='quotes " and \\ and ünïcode',
    )
    exported = tmp_path / "exported.toml"
    exported.write_text(reconcile.export(store.db))
    assert "ghp_" not in exported.read_text()
    plan = reconcile.plan(store.db, key, load(exported), prune=True)
    assert plan.empty, [c.describe() for c in plan.changes]


def test_a_plan_shown_before_the_store_changed_is_not_applied(
    store: Store, key: MasterKey, policy_file: Callable[[str], Path]
) -> None:
    path = policy_file(POLICY)
    shown = reconcile.plan(store.db, key, load(path))
    store.add_principal("agent")  # someone else, meanwhile
    with pytest.raises(Conflict, match="changed since the plan"):
        _apply(store, key, path, expected=shown)
    assert store.list_credentials() == []


def test_a_failed_token_write_leaves_nothing_applied(
    store: Store, key: MasterKey, policy_file: Callable[[str], Path], tmp_path: Path
) -> None:
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    with pytest.raises(Exception, match="cannot write tokens"):
        _apply(store, key, policy_file(POLICY), write_tokens=reconcile.token_writer(blocked / "t"))
    assert store.list_principals() == []


def test_the_proxy_never_sees_half_an_apply(
    store: Store, key: MasterKey, policy_file: Callable[[str], Path]
) -> None:
    """The snapshot (the proxy's one view of the store) shows all of an apply or none of it."""
    grants = "".join(
        f'\n[[grant]]\nid = "g{i}"\nprincipal = "agent"\ncredential = "github"\n'
        f'methods = ["GET"]\npaths = ["/v{i}"]\n'
        for i in range(60)
    )
    path = policy_file(POLICY + grants)
    seen: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.add(len(store.snapshot().grants))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        _apply(store, key, path)
    finally:
        done.set()
        watcher.join()
    seen.add(len(store.snapshot().grants))
    assert seen <= {0, 61}
    assert 61 in seen


def test_limits_round_trip_through_a_policy_file(
    store: Store, key: MasterKey, policy_file: Callable[[str], Path], tmp_path: Path
) -> None:
    limited = POLICY.replace('name = "agent"\n', 'name = "agent"\nrate = "600/m"\nburst = 20\n')
    limited += 'rate = "60/m"\nmax_uses = 100\n'
    applied = _apply(store, key, policy_file(limited))
    assert ("principal", "agent", "create") in [
        (c.kind, c.name, c.action) for c in applied.plan.changes
    ]
    (principal,) = store.list_principals()
    assert (principal.rate, principal.burst) == ("600/m", 20)
    (grant,) = store.list_grants()
    assert (grant.rate, grant.burst, grant.max_uses) == ("60/m", None, 100)
    exported = tmp_path / "exported.toml"
    exported.write_text(reconcile.export(store.db))
    assert reconcile.plan(store.db, key, load(exported), prune=True).empty
    slower = limited.replace('rate = "60/m"', 'rate = "30/m"')
    (change,) = reconcile.plan(store.db, key, load(policy_file(slower))).changes
    assert change.fields == {"rate": ("60/m", "30/m")}


def test_tokens_never_go_through_a_link_or_into_an_open_directory(
    store: Store, key: MasterKey, policy_file: Callable[[str], Path], tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tokens / "agent.token").symlink_to(victim)
    with pytest.raises(InvalidInput, match="is a link or a directory"):
        _apply(store, key, policy_file(POLICY), write_tokens=reconcile.token_writer(tokens))
    assert victim.read_text() == "precious"
    assert store.list_principals() == []
    (tokens / "agent.token").unlink()
    tokens.chmod(0o777)
    with pytest.raises(InvalidInput, match="writable by others"):
        _apply(store, key, policy_file(POLICY), write_tokens=reconcile.token_writer(tokens))
    tokens.chmod(0o700)
    _apply(store, key, policy_file(POLICY), write_tokens=reconcile.token_writer(tokens))
    assert [p.name for p in tokens.iterdir()] == ["agent.token"]
    assert (tokens / "agent.token").stat().st_mode & 0o777 == 0o600


def test_more_uses_for_a_used_up_grant_make_it_usable_again(
    store: Store, key: MasterKey, policy_file: Callable[[str], Path]
) -> None:
    one = POLICY + "max_uses = 1\n"
    _apply(store, key, policy_file(one))
    (grant,) = store.list_grants()
    assert store.use_grant(grant.id) and not store.use_grant(grant.id)
    more = POLICY + "max_uses = 3\n"
    (change,) = reconcile.plan(store.db, key, load(policy_file(more))).changes
    assert change.fields == {"max_uses": (1, 3), "state": ("consumed", "active")}
    _apply(store, key, policy_file(more))
    assert [store.use_grant(grant.id) for _ in range(3)] == [True, True, False]
    assert reconcile.plan(store.db, key, load(policy_file(more))).empty


def test_grants_revoked_with_their_credential_are_shown_in_the_plan(
    store: Store, key: MasterKey, policy_file: Callable[[str], Path]
) -> None:
    _apply(store, key, policy_file(POLICY))
    principal_only = POLICY.split("[[credential]]")[0]
    plan = reconcile.plan(store.db, key, load(policy_file(principal_only)), prune=True)
    assert {(c.kind, c.name, c.action) for c in plan.changes} == {
        ("credential", "github", "remove"),
        ("grant", "triage-widgets", "revoke"),
    }


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        pytest.param(
            'secret_env = "ghp_PASTED_BY_MISTAKE_123"',
            "the variable secret_env names is not set",
            id="a value pasted as secret_env is not echoed",
        ),
        pytest.param(
            'secret_env = "CREDPROXY_MASTER_KEY"',
            "may not name credproxy's own settings",
            id="credproxy's own settings are no secret source",
        ),
    ],
)
def test_secret_sources_that_are_refused(
    store: Store,
    key: MasterKey,
    policy_file: Callable[[str], Path],
    edit: str,
    message: str,
) -> None:
    path = policy_file(POLICY.replace('secret_env = "GITHUB_TOKEN"', edit))
    with pytest.raises(PolicyFileError) as raised:
        _apply(store, key, path)
    assert any(message in p for p in raised.value.problems), raised.value.problems
    assert "ghp_PASTED" not in "".join(raised.value.problems)


def test_a_file_that_nests_too_deeply_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "deep.toml"
    path.write_text("x = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(PolicyFileError, match="nests too deeply"):
        load(path)


SCHEMES = """\
[[principal]]
name = "agent"

[[credential]]
name = "aws"
scheme = "sigv4"
hosts = ["bedrock-runtime.us-east-1.amazonaws.com"]
secret_env = "CP_TEST_AWS"

[[credential]]
name = "telegram"
scheme = "path"
hosts = ["api.telegram.org"]
placeholder = "CREDPROXY_TELEGRAM"
position = ["/bot{}", "/file/bot{}"]
secret_env = "CP_TEST_BOT"

[[grant]]
id = "bot"
principal = "agent"
credential = "telegram"
methods = ["POST"]
paths = ["/botCREDPROXY_TELEGRAM/sendMessage"]
"""


def test_signed_and_path_credentials_take_their_options_from_the_file(
    store: Store,
    key: MasterKey,
    policy_file: Callable[[str], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    aws_secret = '{"access_key_id": "AKIAEXAMPLEKEY12345", "secret_access_key": "wJalrXUtn/K7"}'
    monkeypatch.setenv("CP_TEST_AWS", aws_secret)
    monkeypatch.setenv("CP_TEST_BOT", "123456:ABC-bot-token")
    _apply(store, key, policy_file(SCHEMES))
    by_name = {c.name: c for c in store.list_credentials()}
    assert by_name["aws"].options["access_key_id"] == "…2345"
    assert by_name["telegram"].options["positions"] == ["/bot{}", "/file/bot{}"]
    assert reconcile.plan(store.db, key, load(policy_file(SCHEMES))).empty
    exported = tmp_path / "exported.toml"
    exported.write_text(reconcile.export(store.db))
    assert "AKIA" not in exported.read_text() and "2345" not in exported.read_text()
    assert reconcile.plan(store.db, key, load(exported), prune=True).empty
    moved = SCHEMES.replace('"/bot{}", "/file/bot{}"', '"/bot{}"')
    (change,) = reconcile.plan(store.db, key, load(policy_file(moved))).changes
    assert change.fields.keys() == {"options"}
    bad = SCHEMES.replace(
        'hosts = ["bedrock-runtime.us-east-1.amazonaws.com"]', 'hosts = ["aws.example.com"]'
    )
    with pytest.raises(PolicyFileError, match="cannot tell the service and region"):
        reconcile.plan(store.db, key, load(policy_file(bad)))


def test_approvals_round_trip_through_a_policy_file(
    store: Store, key: MasterKey, policy_file: Callable[[str], Path], tmp_path: Path
) -> None:
    held = POLICY + 'approval = "first"\nhold = "2m"\n'
    _apply(store, key, policy_file(held))
    (grant,) = store.list_grants()
    assert (grant.approval, grant.hold) == ("first", 120)
    exported = tmp_path / "exported.toml"
    exported.write_text(reconcile.export(store.db))
    assert 'approval = "first"' in exported.read_text()
    assert reconcile.plan(store.db, key, load(exported), prune=True).empty
    each = held.replace('"first"', '"each"').replace('"2m"', "30")
    (change,) = reconcile.plan(store.db, key, load(policy_file(each))).changes
    assert change.fields == {"approval": ("first", "each"), "hold": (120, 30)}


@pytest.mark.parametrize(
    ("lines", "says"),
    [
        pytest.param('approval = "always"\n', "invalid approval 'always'", id="bad mode"),
        pytest.param('hold = "30s"\n', "a hold goes with an approval", id="hold alone"),
        pytest.param('approval = "each"\nhold = "1h"\n', "invalid hold '1h'", id="too long"),
        pytest.param('approval = "each"\nhold = true\n', "hold must be seconds", id="not a time"),
    ],
)
def test_bad_approvals_in_a_policy_file_name_their_line(
    policy_file: Callable[[str], Path], lines: str, says: str
) -> None:
    (problem,) = load(policy_file(POLICY + lines)).problems
    assert says in problem and ":" in problem


MINTED = """\
[[credential]]
name = "saas"
scheme = "oauth2-client"
hosts = ["api.saas.example"]
header = "X-Api-Token"
token_url = "https://auth.saas.example/oauth/token"
scope = ["read", "write"]
client_auth = "post"
token_prefix = "token "
secret_env = "CP_TEST_SAAS"

[[credential]]
name = "gh-app"
scheme = "github-app"
hosts = ["api.github.com"]
installation = "42"
repository = ["repo1"]
permission = ["contents=read"]
secret_env = "CP_TEST_APP"
"""


def test_minted_credentials_take_their_options_from_the_file(
    store: Store,
    key: MasterKey,
    policy_file: Callable[[str], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    pem = (
        rsa.generate_private_key(public_exponent=65537, key_size=2048)
        .private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        .decode()
    )
    monkeypatch.setenv("CP_TEST_SAAS", '{"client_id": "c", "client_secret": "s3cret-saas"}')
    monkeypatch.setenv("CP_TEST_APP", json.dumps({"app_id": 7, "private_key": pem}))
    _apply(store, key, policy_file(MINTED))
    by_name = {c.name: c for c in store.list_credentials()}
    assert by_name["saas"].header_name == "X-Api-Token"
    assert by_name["saas"].options == {
        "token_url": "https://auth.saas.example/oauth/token",
        "scope": ["read", "write"],
        "client_auth": "post",
        "token_prefix": "token ",
    }
    assert by_name["gh-app"].options["app_id"] == "7"
    assert by_name["gh-app"].options["permission"] == ["contents=read"]
    assert reconcile.plan(store.db, key, load(policy_file(MINTED))).empty
    exported = tmp_path / "exported.toml"
    exported.write_text(reconcile.export(store.db))
    text = exported.read_text()
    assert "s3cret" not in text and "PRIVATE" not in text and "app_id" not in text
    assert reconcile.plan(store.db, key, load(exported), prune=True).empty
    bad = MINTED.replace("https://auth.saas.example", "http://auth.saas.example")
    with pytest.raises(PolicyFileError, match="must be an https:// URL"):
        reconcile.plan(store.db, key, load(policy_file(bad)))


def test_a_secret_ref_is_stored_as_it_is_exported_back_and_never_read(
    store: Store, key: MasterKey, policy_file: Callable[[str], Path], tmp_path: Path
) -> None:
    """secret_file is read at apply and sealed; secret_ref is kept, and read by the proxy."""
    ref = f"file:{tmp_path}/not-there-at-apply"
    path = policy_file(POLICY.replace('secret_env = "GITHUB_TOKEN"', f'secret_ref = "{ref}"'))
    applied = _apply(store, key, path)
    (change,) = [c for c in applied.plan.changes if c.kind == "credential"]
    assert change.fields["secret_ref"] == (None, ref) and "secret" not in change.fields
    (listed,) = store.list_credentials()
    assert (listed.secret_ref, listed.fingerprint) == (ref, "")
    exported = tmp_path / "exported.toml"
    exported.write_text(reconcile.export(store.db))
    assert f'secret_ref = "{ref}"' in exported.read_text()
    assert reconcile.plan(store.db, key, load(exported), prune=True).empty
    # Back to a sealed secret: the reference goes, the secret is sealed.
    again = _apply(store, key, policy_file(POLICY))
    (change,) = [c for c in again.plan.changes if c.kind == "credential"]
    assert change.fields["secret_ref"] == (ref, None) and "secret" in change.fields
    assert store.snapshot().credentials["github"].secret.reveal() == b"ghp_policy_secret_1"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        pytest.param(
            'secret_ref = "ghp_PASTED_secret"',
            "a secret reference starts with file:",
            id="a secret_ref that does not parse is one line",
        ),
        pytest.param(
            'secret_ref = "file:/run/s"\nsecret_file = "/run/s"',
            "give secret_ref or a secret to seal",
            id="one source of the secret, not two",
        ),
    ],
)
def test_secret_refs_that_are_refused(
    store: Store, key: MasterKey, policy_file: Callable[[str], Path], edit: str, message: str
) -> None:
    path = policy_file(POLICY.replace('secret_env = "GITHUB_TOKEN"', edit))
    with pytest.raises(PolicyFileError) as raised:
        _apply(store, key, path)
    assert any(message in p for p in raised.value.problems), raised.value.problems
    assert "ghp_PASTED" not in "".join(raised.value.problems)
    assert store.list_credentials() == []


def test_an_mtls_credential_from_a_secret_file_round_trips_without_its_hints(
    store: Store, key: MasterKey, policy_file: Callable[[str], Path], tmp_path: Path
) -> None:
    """What `credential list` shows of the certificate is no setting of the file's."""
    import trustme

    pem = tmp_path / "client.pem"
    pem.write_bytes(trustme.CA().issue_cert("c.test").private_key_and_cert_chain_pem.bytes())
    text = POLICY.replace('scheme = "bearer"', 'scheme = "mtls"').replace(
        'secret_env = "GITHUB_TOKEN"', f'secret_file = "{pem}"'
    )
    _apply(store, key, policy_file(text))
    (listed,) = store.list_credentials()
    assert listed.scheme == "mtls"
    assert listed.options["cert_not_after"] == "3000-01-01T00:00:00+00:00"
    exported = reconcile.export(store.db)
    assert "cert_" not in exported
    again = tmp_path / "exported.toml"
    again.write_text(exported)
    assert reconcile.plan(store.db, key, load(again), prune=True).empty
