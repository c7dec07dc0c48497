"""The openai and anthropic Python SDKs, unchanged, through a real proxy with token budgets.

The SDKs need h11 0.16, which mitmproxy (h11 <= 0.14) cannot share a virtual environment
with, so they are installed into a folder of their own (`pip install --target`, from the
package registry) and run in their own interpreter with only the proxy's variables and CA:
as an agent in a sandbox runs them. The provider is tests/e2e/fakemodels.py on 127.0.0.1,
answering JSON and SSE as OpenAI and Anthropic do. Marked slow: the install takes most of a
minute.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from store.crypto import Secret
from store.rules import validation
from tests.e2e.conftest import Proxy
from tests.e2e.fakemodels import COMPLETION, INPUT, OUTPUT, FakeModels

# The fake providers and the proxy in front of them, as the budgets tests start them.
from tests.e2e.test_budgets import models, proxy  # noqa: F401, F811 - fixtures

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SECRET = "sk-sdk-e2e-" + os.urandom(6).hex()
PROMPT = "a prompt the audit stream must never hold"
# Run by the SDKs' interpreter: each call's text and the usage the SDK parsed, as JSON lines.
SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import anthropic, openai

def report(kind, text, usage):
    print(json.dumps({"kind": kind, "text": text, "usage": usage}), flush=True)

o = openai.OpenAI(base_url="https://api.openai.test/v1", api_key="placeholder", max_retries=0)
msgs = [{"role": "user", "content": sys.argv[2]}]
r = o.chat.completions.create(model="gpt-test", messages=msgs)
report("openai", r.choices[0].message.content, [r.usage.prompt_tokens, r.usage.completion_tokens])
text, usage = "", None
for chunk in o.chat.completions.create(
    model="gpt-test", messages=msgs, stream=True, stream_options={"include_usage": True}
):
    if chunk.choices and chunk.choices[0].delta.content:
        text += chunk.choices[0].delta.content
    if chunk.usage:
        usage = [chunk.usage.prompt_tokens, chunk.usage.completion_tokens]
report("openai-stream", text, usage)

a = anthropic.Anthropic(base_url="https://api.anthropic.test", api_key="placeholder",
                        max_retries=0)
m = a.messages.create(model="claude-test", max_tokens=256, messages=msgs)
report("anthropic", m.content[0].text, [m.usage.input_tokens, m.usage.output_tokens])
text, usage = "", [None, None]
with a.messages.stream(model="claude-test", max_tokens=256, messages=msgs) as stream:
    for piece in stream.text_stream:
        text += piece
    final = stream.get_final_message()
report("anthropic-stream", text, [final.usage.input_tokens, final.usage.output_tokens])
try:
    o.chat.completions.create(model="gpt-test", messages=msgs)
except openai.RateLimitError as e:
    report("refused", e.response.headers.get("x-credproxy-reason"), None)
"""


@pytest.fixture(scope="module")
def sdks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """openai and anthropic installed into a folder of their own."""
    target = tmp_path_factory.mktemp("sdks")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--target", str(target),
         "openai>=1.40", "anthropic>=0.34"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        message = f"could not install the SDKs: {done.stderr.strip()[-500:]}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return target


def test_the_sdks_stream_and_are_charged_until_the_budget_refuses_them(
    sdks: Path,
    proxy: Proxy,  # noqa: F811 - the fixture imported above
    models: FakeModels,  # noqa: F811
    names: Callable[[str], str],
    tmp_path: Path,
) -> None:
    agent, cred = names("agent"), names("llm")
    token = proxy.store.add_principal(agent)
    proxy.store.add_credential(
        cred, "bearer", ["api.openai.test", "api.anthropic.test"], Secret(SECRET.encode())
    )
    # Four calls of 120 tokens fit; the fifth is refused before it is sent.
    limits = validation.limits(None, None, budget=("total=480/day",))
    proxy.store.add_grant(agent, ["POST"], credential=cred, paths=["/v1/*"], limits=limits)
    proxy.wait_reload()
    (tmp_path / "home").mkdir()
    url = proxy.url(agent, token)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path / "home"),
        "HTTPS_PROXY": url,
        "https_proxy": url,
        "SSL_CERT_FILE": str(proxy.ca_file),
        "NO_PROXY": "",
    }
    sent = len(models.received)
    done = subprocess.run(
        [sys.executable, "-s", "-c", SCRIPT, str(sdks), PROMPT],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    calls = {c["kind"]: c for c in map(json.loads, done.stdout.splitlines())}
    for kind in ("openai", "openai-stream", "anthropic", "anthropic-stream"):
        assert calls[kind]["text"] == COMPLETION, kind
    assert calls["openai"]["usage"] == calls["openai-stream"]["usage"] == [INPUT, OUTPUT]
    assert calls["refused"]["text"] == "budget-exhausted"
    assert len(models.received) - sent == 4
    charged = [r for r in proxy.requests(agent) if "input_tokens" in r]
    assert len(charged) == 4 and not any(r["tokens_estimated"] for r in charged)
    assert {r["model"] for r in charged} == {"gpt-test", "claude-test"}
    assert SECRET not in done.stdout + done.stderr
    assert PROMPT not in proxy.output() and COMPLETION not in proxy.output()
