"""`credproxy policy suggest` on a real proxy's audit: denied, suggested, planned, applied,
then the same requests allowed, and what lies outside the evidence still refused."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable

import httpx
import pytest

from store.crypto import Secret
from tests.e2e.conftest import CREDPROXY, Proxy
from tests.e2e.upstream import Upstream

pytestmark = pytest.mark.e2e


def cli(proxy: Proxy, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CREDPROXY, *args], env=proxy.env, cwd=proxy.home, capture_output=True, text=True
    )


def test_denied_suggested_applied_then_allowed_and_a_wide_grant_narrowed(
    proxy: Proxy, upstream: Upstream, names: Callable[[str], str]
) -> None:
    agent, cred = names("agent"), names("github")
    token = proxy.store.add_principal(agent)
    proxy.store.add_credential(cred, "bearer", ["api.test"], Secret(b"suggest-e2e-secret"))
    wide = proxy.store.add_grant(agent, ["GET", "POST"], hosts=["other.test"], paths=["/"])
    idle = proxy.store.add_grant(agent, ["GET"], credential=cred, paths=["/v1/"])
    proxy.wait_reload()
    with proxy.client(agent, token) as client:
        denied = [client.get(f"https://api.test/repos/acme/app/issues/{i}") for i in (1, 2, 3)]
        used = [client.get(f"https://other.test/v1/items/{i}") for i in (4, 5, 6)]
        with pytest.raises(httpx.ProxyError):  # no grant names it: the tunnel is refused
            client.get("https://evil.test/x")
    assert [r.json()["reason"] for r in denied] == ["path-not-allowed"] * 3
    assert [r.status_code for r in used] == [200, 200, 200]

    # The proxy's own audit stream, as it wrote it, is the evidence.
    suggested = cli(proxy, "policy", "suggest", str(proxy.stdout), "--out", "suggested.toml")
    assert suggested.returncode == 0, suggested.stderr
    assert suggested.stdout == (
        "wrote suggested.toml: 1 to add, 1 to narrow, 1 unused, 1 hosts refused at CONNECT\n"
    )
    text = (proxy.home / "suggested.toml").read_text()
    assert f'#   grant "grant-{idle}" (grant {idle}): {agent}' in text  # listed, left alone
    assert f'#   {agent}: "evil.test", 1 CONNECTs' in text
    plan = cli(proxy, "plan", "suggested.toml")
    assert plan.returncode == 1, plan.stderr
    assert f"update grant grant-{wide}  methods: [GET, POST] -> [GET]  paths: [/] -> " in (
        plan.stdout
    )
    applied = cli(proxy, "apply", "suggested.toml", "--yes")
    assert applied.returncode == 0, applied.stderr
    proxy.wait_reload()

    with proxy.client(agent, token) as client:
        again = client.get("https://api.test/repos/acme/app/issues/2")
        another_id = client.get("https://api.test/repos/acme/app/issues/77")
        outside = client.get("https://api.test/repos/acme/app/pulls/2")
        other_method = client.delete("https://api.test/repos/acme/app/issues/2")
        narrowed_use = client.get("https://other.test/v1/items/9")
        narrowed_post = client.post("https://other.test/v1/items/9")
        narrowed_path = client.get("https://other.test/v2/")
    assert again.status_code == 200
    (stamped,) = [r for r in upstream.log.requests if r.target == "/repos/acme/app/issues/2"]
    assert stamped.header("authorization") == ["Bearer suggest-e2e-secret"]
    assert another_id.status_code == 200  # the stated rule: three ids made the segment a *
    assert (outside.status_code, outside.json()["reason"]) == (403, "path-not-allowed")
    assert (other_method.status_code, other_method.json()["reason"]) == (
        403,
        "method-not-allowed",
    )
    assert narrowed_use.status_code == 200
    assert narrowed_post.json()["reason"] == "method-not-allowed"
    assert narrowed_path.json()["reason"] == "path-not-allowed"

    # Applied, the same evidence suggests nothing more, and the secret was never written.
    after = cli(proxy, "policy", "suggest", str(proxy.stdout), "--json")
    assert after.returncode == 0, after.stderr
    out = json.loads(after.stdout)
    mine = [a for a in out["add"] if a["principal"] == agent]
    assert mine == [] and [n for n in out["narrow"] if n["grant"] == wide] == []
    for text in (suggested.stdout, plan.stdout, applied.stdout, after.stdout):
        assert "suggest-e2e-secret" not in text
    assert "suggest-e2e-secret" not in (proxy.home / "suggested.toml").read_text()
